// What the coordinator, the agent and the CLI share about the gRPC transport: message size
// limits, channel construction, and the absl::Status <-> grpc::Status conversion at the edge.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"

namespace infersweep::rpc {

// Largest message either side sends or accepts (a sweep spec, a result, a page of results).
inline constexpr int kMaxMessageBytes = 4 * 1024 * 1024;
// Bumped when a message changes meaning; the coordinator rejects other versions.
inline constexpr int kProtocolVersion = 1;

// Keepalive pings on idle connections: sent every kKeepaliveTimeMs, dead after no answer for
// kKeepaliveTimeoutMs.
inline constexpr int kKeepaliveTimeMs = 20'000;
inline constexpr int kKeepaliveTimeoutMs = 10'000;

// An insecure channel to "host:port" with the message size limits and keepalive set.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address);
// The server side of the same: message size limits and keepalive policy.
void ConfigureServer(grpc::ServerBuilder& builder);

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace infersweep::rpc
