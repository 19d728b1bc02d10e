// A hand-driven agent stream, to send what a real agent never would (bad input, floods,
// oversized messages), and a valid TrialResult JSON to send on it.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "api/trial.h"
#include "proto/infersweep.grpc.pb.h"
#include "proto/rpc.h"

namespace infersweep {

struct RawAgent {
  using Stream = grpc::ClientReaderWriter<v1::AgentMessage, v1::CoordinatorMessage>;

  explicit RawAgent(const std::string& address) : RawAgent(rpc::MakeChannel(address)) {}
  explicit RawAgent(const std::shared_ptr<grpc::Channel>& channel)
      : stub(v1::AgentService::NewStub(channel)) {
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    stream = stub->Connect(&context);
  }
  bool Send(const v1::AgentMessage& m) { return stream->Write(m); }
  bool Hello(const std::string& id, const std::string& token = "") {
    v1::AgentMessage m;
    m.mutable_hello()->set_agent_id(id);
    if (!token.empty()) m.mutable_hello()->set_auth_token(token);
    m.mutable_hello()->set_host("test");
    m.mutable_hello()->set_cpu_only(true);
    m.mutable_hello()->set_protocol_version(rpc::kProtocolVersion);
    return Send(m);
  }
  bool Result(const std::string& trial_id, int attempt, const std::string& json) {
    v1::AgentMessage m;
    m.mutable_result()->set_trial_id(trial_id);
    m.mutable_result()->set_attempt(attempt);
    m.mutable_result()->set_result_json(json);
    return Send(m);
  }
  v1::CoordinatorMessage Next() {
    v1::CoordinatorMessage m;
    if (!stream->Read(&m)) m.Clear();
    return m;
  }
  grpc::Status End() {
    stream->WritesDone();
    v1::CoordinatorMessage m;
    while (stream->Read(&m)) {
    }
    return stream->Finish();
  }

  std::unique_ptr<v1::AgentService::Stub> stub;
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream;
};

// An OK CPU result of `trial_id`'s attempt; `reason` tells two results of one attempt apart.
inline std::string ValidResultJson(const std::string& trial_id, int attempt,
                                   const std::string& reason = "") {
  TrialResult r;
  r.reason = reason;
  r.trial_id = trial_id;
  r.attempt = attempt;
  r.status = TrialStatus::kOk;
  r.model = "preset:tiny-moe";
  r.config = {{"device", "cpu"}, {"matmul", "naive"}};
  r.device = "cpu";
  return ToJson(r).dump();
}

}  // namespace infersweep
