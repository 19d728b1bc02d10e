// Helpers for the tests and benchmarks that run real processes (the fault tests through
// tests/fleet_process.h, bench/fleet_bench.cc): a child process in its own process group whose
// output the caller collects, and a TCP proxy on loopback that a test can cut to partition an
// agent from the coordinator.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace infersweep {

// A child process started with fork/exec in a new process group (so that the test can kill it
// with everything it started), stdout and stderr read into memory by a thread. The destructor
// SIGKILLs the group and reaps the child.
class ChildProcess {
 public:
  // Starts argv[0] (a path) with argv. Returns null when fork or pipe fails.
  static std::unique_ptr<ChildProcess> Start(const std::vector<std::string>& argv) {
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) return nullptr;
    std::vector<char*> args;
    std::vector<std::string> copy = argv;
    for (std::string& a : copy) args.push_back(a.data());
    args.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
      close(out[0]);
      close(out[1]);
      return nullptr;
    }
    if (pid == 0) {
      setpgid(0, 0);
      dup2(out[1], 1);
      dup2(out[1], 2);
      execv(args[0], args.data());
      _exit(127);
    }
    setpgid(pid, pid);  // also here: no race with a kill before the child ran setpgid
    close(out[1]);
    std::unique_ptr<ChildProcess> p(new ChildProcess(pid, out[0]));
    return p;
  }

  ~ChildProcess() {
    KillGroup(SIGKILL);
    Reap();
    if (reader_.joinable()) reader_.join();
    close(fd_);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  // Sends `sig` to the process only.
  void Signal(int sig) {
    if (!exited_) kill(pid_, sig);
  }
  // Sends `sig` to the process group: the process and the children it started (workers). Only
  // while the process is not reaped, so that its id cannot belong to another process yet.
  void KillGroup(int sig) {
    if (!exited_) kill(-pid_, sig);
  }
  // Waits up to `seconds` for the process to exit; true when it did (`status` as waitpid's).
  bool WaitExit(double seconds, int* status = nullptr) {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
    while (!exited_) {
      int st = 0;
      const pid_t r = waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        status_ = st;
        break;
      }
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (status) *status = status_;
    return true;
  }
  bool running() { return !WaitExit(0); }
  // Everything the process wrote on stdout and stderr so far.
  std::string Output() {
    std::lock_guard<std::mutex> lock(mu_);
    return output_;
  }

 private:
  ChildProcess(pid_t pid, int fd) : pid_(pid), fd_(fd) {
    reader_ = std::thread([this] {
      char buf[4096];
      while (true) {
        const ssize_t n = read(fd_, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        std::lock_guard<std::mutex> lock(mu_);
        output_.append(buf, static_cast<size_t>(n));
      }
    });
  }
  void Reap() {
    if (!exited_) WaitExit(30);
  }

  const pid_t pid_;
  const int fd_;
  bool exited_ = false;
  int status_ = 0;
  std::thread reader_;
  std::mutex mu_;
  std::string output_;
};

// A TCP proxy on 127.0.0.1 (a free port) to 127.0.0.1:target_port. Cut() resets every
// connection through it and refuses new ones until Restore(): a network partition between the
// clients and the target, as the clients see it.
class TcpProxy {
 public:
  explicit TcpProxy(int target_port) : target_port_(target_port) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        listen(listen_fd_, 64) != 0)
      return;
    socklen_t len = sizeof addr;
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Loop(); });
  }
  ~TcpProxy() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    for (auto& [a, b] : pairs_) {
      close(a);
      close(b);
    }
    close(listen_fd_);
  }
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  // The port clients connect to; 0 when the proxy could not listen.
  int port() const { return port_; }
  void Cut() { cut_ = true; }
  void Restore() { cut_ = false; }
  // Connections accepted so far (refused ones included).
  int accepted() const { return accepted_; }

 private:
  static void Reset(int fd) {
    linger l{1, 0};  // close with RST, as a dropped route or a rebooted middlebox would
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    close(fd);
  }
  int ConnectTarget() const {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(target_port_));
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      close(fd);
      return -1;
    }
    return fd;
  }
  // Copies what `from` has to `to`; false when either side is done.
  static bool Pump(int from, int to) {
    char buf[65536];
    const ssize_t n = read(from, buf, sizeof buf);
    if (n <= 0) return n < 0 && (errno == EINTR || errno == EAGAIN);
    for (ssize_t done = 0; done < n;) {
      const ssize_t w = write(to, buf + done, static_cast<size_t>(n - done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return false;
      done += w;
    }
    return true;
  }
  void Loop() {
    while (!stop_) {
      if (cut_) {
        for (auto& [a, b] : pairs_) {
          Reset(a);
          Reset(b);
        }
        pairs_.clear();
      }
      std::vector<pollfd> fds;
      fds.push_back({listen_fd_, POLLIN, 0});
      for (auto& [a, b] : pairs_) {
        fds.push_back({a, POLLIN, 0});
        fds.push_back({b, POLLIN, 0});
      }
      if (poll(fds.data(), fds.size(), 20) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (client >= 0) {
          ++accepted_;
          const int upstream = cut_ ? -1 : ConnectTarget();
          if (upstream < 0) {
            Reset(client);
          } else {
            pairs_.emplace_back(client, upstream);
          }
        }
      }
      std::vector<std::pair<int, int>> alive;
      for (size_t i = 0; i < pairs_.size(); ++i) {
        const auto& ca = fds[1 + 2 * i];
        const auto& cb = fds[2 + 2 * i];
        bool ok = true;
        if (ca.revents & (POLLIN | POLLHUP | POLLERR)) ok = Pump(pairs_[i].first, pairs_[i].second);
        if (ok && (cb.revents & (POLLIN | POLLHUP | POLLERR)))
          ok = Pump(pairs_[i].second, pairs_[i].first);
        if (ok) {
          alive.push_back(pairs_[i]);
        } else {
          close(pairs_[i].first);
          close(pairs_[i].second);
        }
      }
      pairs_ = std::move(alive);
    }
  }

  const int target_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> cut_{false};
  std::atomic<int> accepted_{0};
  std::vector<std::pair<int, int>> pairs_;  // client, upstream (loop thread only)
  std::thread thread_;
};

}  // namespace infersweep
