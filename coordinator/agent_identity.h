// Who an agent stream is: its Hello names an agent id, and its credentials must prove it
// (docs/SECURITY.md "Agent identity").
//
//  - Per-agent tokens (--agent-tokens-file): each agent id has its own token; a Hello's token
//    must be the one of the id it names.
//  - Client certificates (mutual TLS): the certificate's CN or one of its DNS names must be the
//    agent id.
//  - A shared agent token (--agent-token-file) or no token proves nothing about the id: such a
//    stream is unbound, and only its peer address tells one stream of an id from another.
//
// A credential's fingerprint is what a second stream for a connected agent id must present to
// replace the first (an agent that reconnects before its old stream was noticed dead): the
// certificate's SHA-256, or the token's id, or, unbound, the peer's host.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace grpc {
class ServerContext;
}

namespace infersweep {

// What the transport says of a peer.
struct PeerCredentials {
  std::string host;                     // the address without the port
  bool has_certificate = false;         // a verified client certificate (mutual TLS)
  std::vector<std::string> cert_names;  // its CN and DNS subject alternative names
  std::string cert_sha256;              // of its PEM
};

PeerCredentials PeerCredentialsOf(const grpc::ServerContext& context);

// The proven identity of a stream.
struct AgentCredential {
  std::string fingerprint;  // "cert:<sha256>", "token" or "addr:<host>"
  bool bound = false;       // the credential proves the agent id
};

struct AgentAuthOptions {
  std::string shared_token;                         // empty: none
  std::map<std::string, std::string> agent_tokens;  // agent id -> its token; empty: none
  // The client certificate must name the agent id (on whenever clients present certificates,
  // unless turned off for a fleet whose certificates name hosts otherwise).
  bool bind_to_certificate = true;
};

class AgentAuthenticator {
 public:
  // InvalidArgument when both a shared token and per-agent tokens are given.
  static absl::StatusOr<AgentAuthenticator> Create(AgentAuthOptions options);
  AgentAuthenticator() = default;

  // Unauthenticated: the token is missing or wrong for `agent_id` (the same words whether or not
  // the id is known). PermissionDenied: the certificate does not name `agent_id`, saying which
  // names it has.
  absl::StatusOr<AgentCredential> Authenticate(const std::string& agent_id, std::string_view token,
                                               const PeerCredentials& peer) const;

  // One line for the coordinator's start-up banner: how agent ids are bound, given whether
  // clients present certificates.
  std::string Describe(bool client_certificates) const;
  bool token_required() const { return !options_.shared_token.empty() || per_agent(); }
  bool per_agent() const { return !options_.agent_tokens.empty(); }

 private:
  explicit AgentAuthenticator(AgentAuthOptions options) : options_(std::move(options)) {}
  AgentAuthOptions options_;
};

// Reads a per-agent token file: one "AGENT_ID TOKEN" a line; blank lines and lines starting
// with '#' are skipped. Refused, naming path:line: a malformed line, an invalid agent id, an id
// or a token given twice, a token shorter than 16 characters, a file others can read.
absl::StatusOr<std::map<std::string, std::string>> ReadAgentTokensFile(const std::string& path);

// 1..128 characters of [A-Za-z0-9._:-].
bool ValidAgentId(std::string_view id);
inline constexpr size_t kMaxAgentIdLength = 128;

}  // namespace infersweep
