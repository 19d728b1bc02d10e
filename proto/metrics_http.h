// A minimal HTTP/1.0 server for Prometheus scrapes: GET (or HEAD) /metrics answers the text
// exposition a callback renders; anything else gets 404 or 405. One thread serves one connection
// at a time (scrapes are small and sequential), with read and write timeouts so a stalled client
// cannot hold it, and a bounded request size.
//
// Why not prometheus::Exposer (civetweb): civetweb starts its threads with a fixed 100 KiB stack,
// and glibc places a process's static TLS on every thread's stack; CUDA builds link libcublasLt,
// whose static TLS alone is ~94 KiB, so civetweb cannot start a thread and the Exposer throws.
// This server's thread has the default stack size.
//
// Part of infersweep_proto, which both the coordinator (coordinator/metrics.cc) and the agent
// (agent/metrics.cc) link, so neither depends on the other for it.
#pragma once

#include <functional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace infersweep {

class MetricsHttpServer {
 public:
  using Render = std::function<std::string()>;

  MetricsHttpServer() = default;
  ~MetricsHttpServer() { Stop(); }
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Binds `address` ("127.0.0.1:9464", "0.0.0.0:9464", "[::1]:0", "localhost:0"; port 0 picks
  // a free one) and starts serving. Returns the bound port.
  absl::StatusOr<int> Start(const std::string& address, Render render);
  // Stops serving and closes the socket. Idempotent.
  void Stop();

  int port() const { return port_; }

 private:
  void Serve();
  void Handle(int conn);

  Render render_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  int port_ = 0;
  std::thread thread_;
};

}  // namespace infersweep
