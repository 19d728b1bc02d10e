#include "proto/metrics_http.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace infersweep {

namespace {

constexpr size_t kMaxRequestBytes = 8192;

void Reply(int conn, int code, const char* type, const std::string& body, bool with_body) {
  const char* reason = code == 200   ? "OK"
                       : code == 404 ? "Not Found"
                       : code == 405 ? "Method Not Allowed"
                       : code == 431 ? "Request Header Fields Too Large"
                                     : "Bad Request";
  std::string out =
      absl::StrCat("HTTP/1.0 ", code, " ", reason, "\r\nContent-Type: ", type,
                   "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n");
  if (with_body) out += body;
  size_t sent = 0;
  while (sent < out.size()) {
    const ssize_t n = send(conn, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace

absl::StatusOr<int> MetricsHttpServer::Start(const std::string& address, Render render) {
  if (thread_.joinable()) return absl::FailedPreconditionError("metrics: already listening");
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size())
    return absl::InvalidArgumentError(absl::StrCat("metrics: '", address, "' is not host:port"));
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  if (port.find_first_not_of("0123456789") != std::string::npos || port.size() > 5)
    return absl::InvalidArgumentError(
        absl::StrCat("metrics: '", address, "': the port must be a number"));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
  if (gai != 0)
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on '", address, "': ", gai_strerror(gai)));
  std::string error = "no usable address";
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 16) != 0) {
      error = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0)
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on '", address, "': ", error));
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (pipe2(wake_, O_CLOEXEC) != 0) {
    close(fd);
    return absl::InternalError(absl::StrCat("metrics: pipe: ", std::strerror(errno)));
  }
  listen_fd_ = fd;
  render_ = std::move(render);
  thread_ = std::thread([this] { Serve(); });
  return port_;
}

void MetricsHttpServer::Stop() {
  if (!thread_.joinable()) return;
  const char byte = 1;
  (void)!write(wake_[1], &byte, 1);
  thread_.join();
  close(listen_fd_);
  close(wake_[0]);
  close(wake_[1]);
  listen_fd_ = wake_[0] = wake_[1] = -1;
}

void MetricsHttpServer::Serve() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    timeval read_timeout{2, 0}, write_timeout{5, 0};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &read_timeout, sizeof(read_timeout));
    setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &write_timeout, sizeof(write_timeout));
    Handle(conn);
    close(conn);
  }
}

void MetricsHttpServer::Handle(int conn) {
  std::string request;
  char buf[1024];
  while (request.find("\r\n\r\n") == std::string::npos &&
         request.find("\n\n") == std::string::npos) {
    if (request.size() > kMaxRequestBytes)
      return Reply(conn, 431, "text/plain", "too large\n", true);
    const ssize_t n = read(conn, buf, sizeof(buf));
    if (n <= 0) return;  // closed or timed out
    request.append(buf, static_cast<size_t>(n));
  }
  const size_t eol = request.find_first_of("\r\n");
  const std::string line = request.substr(0, eol);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = line.find(' ', sp1 == std::string::npos ? sp1 : sp1 + 1);
  if (sp1 == std::string::npos) return Reply(conn, 400, "text/plain", "bad request\n", true);
  const std::string method = line.substr(0, sp1);
  std::string target =
      line.substr(sp1 + 1, sp2 == std::string::npos ? std::string::npos : sp2 - sp1 - 1);
  const size_t query = target.find('?');
  if (query != std::string::npos) target.resize(query);
  const bool head = method == "HEAD";
  if (method != "GET" && !head) return Reply(conn, 405, "text/plain", "GET only\n", !head);
  if (target == "/metrics") {
    return Reply(conn, 200, "text/plain; version=0.0.4; charset=utf-8", render_(), !head);
  }
  if (target == "/") {
    return Reply(conn, 200, "text/html; charset=utf-8",
                 "<html><body><a href=\"/metrics\">/metrics</a></body></html>\n", !head);
  }
  Reply(conn, 404, "text/plain", "not found: try /metrics\n", !head);
}

}  // namespace infersweep
