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
// Most spooled results an agent lists in its Hello (Hello.spooled); an agent with more lists
// none and leaves Hello.reports_spool false.
inline constexpr int kMaxHelloSpooled = 10000;
// Rows of one QueryResults reply: at most kMaxQueryRows, kDefaultQueryRows when the request
// leaves its limit unset.
inline constexpr int kMaxQueryRows = 10000;
inline constexpr int kDefaultQueryRows = 1000;

// Keepalive pings on idle connections: sent every kKeepaliveTimeMs, dead after no answer for
// kKeepaliveTimeoutMs.
inline constexpr int kKeepaliveTimeMs = 20'000;
inline constexpr int kKeepaliveTimeoutMs = 10'000;

// TLS on the gRPC port (docs/SERVICE.md "TLS"). Every file holds PEM. Empty fields mean
// plaintext (the default, for loopback and trusted networks).
struct TlsOptions {
  // Server side: the coordinator's certificate chain and private key. When client_ca_file is
  // also set, every client must present a certificate issued by that CA (mutual TLS).
  // Client side: cert_file/key_file are the client's certificate for mutual TLS (optional).
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;
  // Client side: the CA that verifies the coordinator's certificate. Setting it (or a client
  // certificate) turns TLS on for the channel.
  std::string ca_file;
  // Client side, tests and odd DNS only: the name expected in the server's certificate instead
  // of the host in the address.
  std::string server_name_override;

  bool server_enabled() const { return !cert_file.empty() || !key_file.empty(); }
  bool client_enabled() const {
    return !ca_file.empty() || !cert_file.empty() || !key_file.empty();
  }
};

// Reads a PEM file whole. A missing, unreadable or empty file is an error naming the path and
// `what` ("TLS certificate", ...).
absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& what);
// A secret (token, TLS private key) that other users can read or write is refused, like ssh
// does with its keys: PermissionDenied naming `what`, the file and its mode. Group access stays
// allowed (Kubernetes mounts secrets 0440 for the pod's fsGroup). A file that cannot be
// stat'ed passes here; reading it reports the error.
absl::Status CheckSecretFileMode(const std::string& path, const std::string& what);
// Server credentials: insecure when no certificate is given; TLS with cert/key; mutual TLS
// (client certificate required and verified) when client_ca_file is set too. Both credential
// makers refuse a private key file others can read (CheckSecretFileMode).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& tls);
// Channel credentials: insecure unless tls.client_enabled(); TLS verified against ca_file (the
// system roots when empty), with the client certificate when cert_file/key_file are set.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& tls);

// A channel to "host:port" with the message size limits and keepalive set; insecure when
// `credentials` is null. `server_name_override` (TLS only) is the name checked in the server's
// certificate instead of the host.
std::shared_ptr<grpc::Channel> MakeChannel(
    const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr,
    const std::string& server_name_override = "");
// The server side of the same: message size limits and keepalive policy.
void ConfigureServer(grpc::ServerBuilder& builder);

// Bearer-token authentication (docs/SERVICE.md "Authentication"). User-API calls carry the
// metadata kAuthMetadataKey: "Bearer <token>"; agents carry theirs in Hello.auth_token.
inline constexpr char kAuthMetadataKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";
// Equal strings, in time that depends on the lengths only, not on where they differ.
bool ConstantTimeEquals(std::string_view a, std::string_view b);
// Reads a token file: its content less trailing whitespace. A missing, unreadable or empty file
// is an error naming the path (never the content); so is one others can read (CheckSecretFileMode).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace infersweep::rpc
