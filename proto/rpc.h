// What the coordinator, the agent and the CLI share about the gRPC transport: message size
// limits, channel construction, and the absl::Status <-> grpc::Status conversion at the edge.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

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

// Bearer-token authentication (docs/SERVICE.md "Authentication"). User-API calls carry the
// metadata kAuthMetadataKey: "Bearer <token>"; agents carry theirs in Hello.auth_token.
inline constexpr char kAuthMetadataKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";
// Equal strings, in time that depends on the lengths only, not on where they differ.
bool ConstantTimeEquals(std::string_view a, std::string_view b);
// Reads a token file: its content less trailing whitespace. A missing, unreadable or empty file
// is an error naming the path (never the content).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace infersweep::rpc
