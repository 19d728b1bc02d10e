#include "api/private_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace infersweep {

absl::Status CreatePrivateFile(const std::string& path, unsigned mode) {
  if (path.empty() || path == ":memory:" || path.rfind("file:", 0) == 0) return absl::OkStatus();
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) {
    if (errno == EEXIST) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  }
  // open() applied the umask; the mode asked for is the mode the file gets.
  const int rc = fchmod(fd, mode);
  const int chmod_errno = errno;
  close(fd);
  if (rc != 0)
    return absl::FailedPreconditionError(
        absl::StrCat("cannot set the mode of ", path, ": ", std::strerror(chmod_errno)));
  return absl::OkStatus();
}

}  // namespace infersweep
