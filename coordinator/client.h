// A blocking client of the coordinator's user API (SweepService), for the CLI and tests.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/status/status.h"
#include "proto/infersweep.grpc.pb.h"
#include "proto/rpc.h"

namespace infersweep {

class ServiceClient {
 public:
  // `address` is "host:port"; every call fails after `timeout_ms`. A non-empty `token` is sent
  // on every call as the metadata "authorization: Bearer <token>" (docs/SERVICE.md). `tls`
  // (client side: ca_file, cert_file/key_file, server_name_override) turns on TLS; a bad TLS
  // file makes every call fail with that error (see tls_status()).
  explicit ServiceClient(const std::string& address, int64_t timeout_ms = 30'000,
                         std::string token = "", const rpc::TlsOptions& tls = {});

  void set_token(std::string token) { token_ = std::move(token); }
  // For the calls that follow: the deadline of each, and whether a call made while the
  // coordinator cannot be reached waits for the channel to connect (up to that deadline: gRPC's
  // wait_for_ready) instead of failing at once with UNAVAILABLE. A waiting call drives the
  // reconnection, so it succeeds as soon as the coordinator is back.
  void set_timeout_ms(int64_t timeout_ms) { timeout_ms_ = timeout_ms; }
  void set_wait_for_ready(bool wait) { wait_for_ready_ = wait; }

  absl::StatusOr<v1::SubmitSweepResponse> SubmitSweep(const std::string& yaml,
                                                      const std::string& source);
  absl::StatusOr<v1::SweepInfo> GetSweep(int64_t sweep_id);
  absl::StatusOr<v1::ListSweepsResponse> ListSweeps();
  absl::StatusOr<v1::CancelSweepResponse> CancelSweep(int64_t sweep_id);
  absl::StatusOr<v1::ListAgentsResponse> ListAgents();
  absl::StatusOr<v1::QueryResultsResponse> QueryResults(const v1::QueryResultsRequest& request);
  absl::StatusOr<v1::BestResponse> Best(const v1::BestRequest& request);
  absl::StatusOr<v1::RegressionsResponse> Regressions(const v1::RegressionsRequest& request);

  const std::string& address() const { return address_; }
  // Not OK when the TLS options could not be turned into credentials (unreadable file, ...).
  const absl::Status& tls_status() const { return tls_status_; }

 private:
  template <typename Req, typename Resp, typename Method>
  absl::StatusOr<Resp> Call(const Req& request, Method method);

  std::string address_;
  int64_t timeout_ms_;
  bool wait_for_ready_ = false;
  std::string token_;
  absl::Status tls_status_;
  std::unique_ptr<v1::SweepService::Stub> stub_;
};

}  // namespace infersweep
