#include "engine/cudnn_loader.h"

#include <dlfcn.h>
#include <glob.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace infersweep {
namespace {

constexpr char kSoname[] = "libcudnn.so.9";

// The paths `pattern` matches, sorted (glob's order); none when it matches nothing.
std::vector<std::string> Glob(const std::string& pattern) {
  std::vector<std::string> out;
  glob_t g{};
  if (glob(pattern.c_str(), 0, nullptr, &g) == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  return out;
}

}  // namespace

std::string CudnnVersionText(size_t v) {
  return absl::StrCat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

std::vector<std::string> CudnnCandidates(std::string_view ld_library_path,
                                         const std::vector<std::string>& extra_dirs) {
  std::vector<std::string> dirs;
  for (absl::string_view d :
       absl::StrSplit(absl::string_view(ld_library_path.data(), ld_library_path.size()), ':',
                      absl::SkipEmpty()))
    dirs.emplace_back(d);
  for (const std::string& d : extra_dirs)
    if (!d.empty()) dirs.push_back(d);
  for (const char* pattern : {"/usr/local/lib/python3*/dist-packages/nvidia/cudnn/lib",
                              "/usr/local/lib/python3*/site-packages/nvidia/cudnn/lib",
                              "/usr/lib/python3/dist-packages/nvidia/cudnn/lib"})
    for (std::string& d : Glob(pattern)) dirs.push_back(std::move(d));
  std::vector<std::string> files;
  for (const std::string& d : dirs) files.push_back(absl::StrCat(d, "/", kSoname));
  return files;
}

absl::StatusOr<CudnnLibrary> LoadCudnnFrom(const std::vector<std::string>& candidates) {
  std::vector<std::string> errors;
  for (const std::string& path : candidates) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      // A file that exists but does not load (wrong arch, missing dependencies) is worth naming.
      if (why != nullptr && std::string(why).find("No such file") == std::string::npos)
        errors.push_back(why);
      continue;
    }
    using GetVersion = size_t (*)();
    auto get_version = reinterpret_cast<GetVersion>(dlsym(handle, "cudnnGetVersion"));
    if (get_version == nullptr) {
      errors.push_back(absl::StrCat(path, ": no cudnnGetVersion"));
      dlclose(handle);
      continue;
    }
    return CudnnLibrary{handle, path, get_version()};
  }
  std::string looked;
  for (const std::string& c : candidates) absl::StrAppend(&looked, looked.empty() ? "" : ", ", c);
  return absl::NotFoundError(absl::StrCat(
      kSoname, " not found (looked for ", looked.empty() ? "nothing: no candidates" : looked, ")",
      errors.empty() ? "" : absl::StrCat("; ", absl::StrJoin(errors, "; "))));
}

absl::StatusOr<const CudnnLibrary*> ProcessCudnn() {
  static const absl::StatusOr<CudnnLibrary>* loaded = [] {
    const char* ld = std::getenv("LD_LIBRARY_PATH");
    const char* extra = std::getenv("INFERSWEEP_CUDNN_DIR");
    return new absl::StatusOr<CudnnLibrary>(
        LoadCudnnFrom(CudnnCandidates(ld ? ld : "", {extra ? extra : ""})));
  }();
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

absl::Status RequireCudnn(const absl::StatusOr<const CudnnLibrary*>& library, size_t min_version,
                          std::string_view who) {
  const std::string need =
      absl::StrCat(std::string(who), " needs cuDNN >= ", CudnnVersionText(min_version));
  if (!library.ok())
    return absl::UnimplementedError(absl::StrCat(need, ": ", library.status().message()));
  if ((*library)->version < min_version)
    return absl::UnimplementedError(absl::StrCat(
        need, "; found ", CudnnVersionText((*library)->version), " (", (*library)->path, ")"));
  return absl::OkStatus();
}

}  // namespace infersweep
