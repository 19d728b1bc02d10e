#include "coordinator/client.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/rpc.h"

namespace infersweep {

ServiceClient::ServiceClient(const std::string& address, int64_t timeout_ms, std::string token,
                             const rpc::TlsOptions& tls)
    : address_(address), timeout_ms_(timeout_ms), token_(std::move(token)) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      rpc::MakeChannelCredentials(tls);
  if (!credentials.ok()) {
    tls_status_ = credentials.status();
    credentials = grpc::InsecureChannelCredentials();  // never used: every call fails first
  }
  stub_ = v1::SweepService::NewStub(
      rpc::MakeChannel(address, *credentials, tls.server_name_override));
}

template <typename Req, typename Resp, typename Method>
absl::StatusOr<Resp> ServiceClient::Call(const Req& request, Method method) {
  if (!tls_status_.ok()) return tls_status_;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms_));
  context.set_wait_for_ready(wait_for_ready_);
  if (!token_.empty()) context.AddMetadata(rpc::kAuthMetadataKey, absl::StrCat(rpc::kBearerPrefix, token_));
  Resp response;
  const grpc::Status status = ((*stub_).*method)(&context, request, &response);
  if (status.ok()) return response;
  absl::Status s = rpc::FromGrpcStatus(status);
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
    return absl::Status(s.code(), absl::StrCat("coordinator at ", address_, ": ", s.message()));
  return s;
}

absl::StatusOr<v1::SubmitSweepResponse> ServiceClient::SubmitSweep(const std::string& yaml,
                                                                   const std::string& source) {
  v1::SubmitSweepRequest req;
  req.set_spec_yaml(yaml);
  req.set_source(source);
  return Call<v1::SubmitSweepRequest, v1::SubmitSweepResponse>(req,
                                                               &v1::SweepService::Stub::SubmitSweep);
}

absl::StatusOr<v1::SweepInfo> ServiceClient::GetSweep(int64_t sweep_id) {
  v1::GetSweepRequest req;
  req.set_sweep_id(sweep_id);
  return Call<v1::GetSweepRequest, v1::SweepInfo>(req, &v1::SweepService::Stub::GetSweep);
}

absl::StatusOr<v1::ListSweepsResponse> ServiceClient::ListSweeps() {
  return Call<v1::ListSweepsRequest, v1::ListSweepsResponse>(v1::ListSweepsRequest(),
                                                             &v1::SweepService::Stub::ListSweeps);
}

absl::StatusOr<v1::CancelSweepResponse> ServiceClient::CancelSweep(int64_t sweep_id) {
  v1::CancelSweepRequest req;
  req.set_sweep_id(sweep_id);
  return Call<v1::CancelSweepRequest, v1::CancelSweepResponse>(req,
                                                               &v1::SweepService::Stub::CancelSweep);
}

absl::StatusOr<v1::ListAgentsResponse> ServiceClient::ListAgents() {
  return Call<v1::ListAgentsRequest, v1::ListAgentsResponse>(v1::ListAgentsRequest(),
                                                             &v1::SweepService::Stub::ListAgents);
}

absl::StatusOr<v1::QueryResultsResponse> ServiceClient::QueryResults(
    const v1::QueryResultsRequest& request) {
  return Call<v1::QueryResultsRequest, v1::QueryResultsResponse>(
      request, &v1::SweepService::Stub::QueryResults);
}

absl::StatusOr<v1::BestResponse> ServiceClient::Best(const v1::BestRequest& request) {
  return Call<v1::BestRequest, v1::BestResponse>(request, &v1::SweepService::Stub::Best);
}

absl::StatusOr<v1::RegressionsResponse> ServiceClient::Regressions(
    const v1::RegressionsRequest& request) {
  return Call<v1::RegressionsRequest, v1::RegressionsResponse>(
      request, &v1::SweepService::Stub::Regressions);
}

}  // namespace infersweep
