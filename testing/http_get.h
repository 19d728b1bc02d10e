// A plain HTTP/1.0 GET on loopback, for the tests and benchmarks that read /metrics.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"

namespace infersweep {

// GET http://127.0.0.1:<port><path>; returns the status line and the body.
struct HttpResponse {
  std::string status_line;
  std::string body;
};
inline std::optional<HttpResponse> HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return std::nullopt;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return std::nullopt;
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return std::nullopt;
  }
  std::string raw;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) raw.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t eol = raw.find("\r\n");
  const size_t split = raw.find("\r\n\r\n");
  if (eol == std::string::npos || split == std::string::npos) return std::nullopt;
  return HttpResponse{raw.substr(0, eol), raw.substr(split + 4)};
}

}  // namespace infersweep
