#include "coordinator/agent_identity.h"

#include <grpcpp/grpcpp.h>

#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "api/digest.h"
#include "api/status_macros.h"
#include "coordinator/rate_limit.h"
#include "proto/rpc.h"

namespace infersweep {
namespace {

constexpr size_t kMinAgentTokenLength = 16;

std::string Text(const grpc::string_ref& s) { return std::string(s.data(), s.size()); }

}  // namespace

bool ValidAgentId(std::string_view id) {
  if (id.empty() || id.size() > kMaxAgentIdLength) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-' || c == ':';
    if (!ok) return false;
  }
  return true;
}

PeerCredentials PeerCredentialsOf(const grpc::ServerContext& context) {
  PeerCredentials peer;
  peer.host = PeerHost(context.peer());
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return peer;
  const std::vector<grpc::string_ref> pem = auth->FindPropertyValues("x509_pem_cert");
  if (pem.empty()) return peer;
  peer.has_certificate = true;
  peer.cert_sha256 = Sha256Hex(std::string_view(pem[0].data(), pem[0].size()));
  std::set<std::string> names;
  for (const char* property : {"x509_common_name", "peer_dns"})
    for (const grpc::string_ref& name : auth->FindPropertyValues(property))
      if (names.insert(Text(name)).second) peer.cert_names.push_back(Text(name));
  return peer;
}

absl::StatusOr<AgentAuthenticator> AgentAuthenticator::Create(AgentAuthOptions options) {
  if (!options.shared_token.empty() && !options.agent_tokens.empty())
    return absl::InvalidArgumentError(
        "a shared agent token and per-agent tokens are alternatives: with both, the shared one "
        "would let any agent report as any id; give one");
  return AgentAuthenticator(std::move(options));
}

absl::StatusOr<AgentCredential> AgentAuthenticator::Authenticate(
    const std::string& agent_id, std::string_view token, const PeerCredentials& peer) const {
  static const absl::Status kInvalid =
      absl::UnauthenticatedError("Hello: missing or invalid credentials");
  AgentCredential credential;
  if (per_agent()) {
    auto it = options_.agent_tokens.find(agent_id);
    // An unknown id is compared too, so the time taken does not say which ids exist.
    const std::string_view expected =
        it != options_.agent_tokens.end() ? std::string_view(it->second) : std::string_view("-");
    const bool equal = rpc::ConstantTimeEquals(token, expected);
    if (it == options_.agent_tokens.end() || !equal) return kInvalid;
    credential.fingerprint = "token";
    credential.bound = true;
  } else if (!options_.shared_token.empty()) {
    if (!rpc::ConstantTimeEquals(token, options_.shared_token)) return kInvalid;
  }
  if (peer.has_certificate && options_.bind_to_certificate) {
    bool named = false;
    for (const std::string& name : peer.cert_names) named = named || name == agent_id;
    if (!named)
      return absl::PermissionDeniedError(absl::StrCat(
          "Hello: agent id '", agent_id, "' is not named by the client certificate (it names ",
          peer.cert_names.empty() ? std::string("nothing")
                                  : absl::StrCat("'", absl::StrJoin(peer.cert_names, "', '"), "'"),
          "); an agent's certificate must carry its id as CN or DNS name"));
    credential.fingerprint = absl::StrCat("cert:", peer.cert_sha256);
    credential.bound = true;
  }
  if (!credential.bound) credential.fingerprint = absl::StrCat("addr:", peer.host);
  return credential;
}

std::string AgentAuthenticator::Describe(bool client_certificates) const {
  std::vector<std::string> binding;
  if (per_agent())
    binding.push_back(absl::StrCat("per-agent tokens (", options_.agent_tokens.size(), " agents)"));
  if (client_certificates && options_.bind_to_certificate)
    binding.push_back("client certificates naming the agent id");
  if (!binding.empty()) return absl::StrCat("agent ids bound to ", absl::StrJoin(binding, " and "));
  return absl::StrCat(
      "agent ids NOT bound to credentials (",
      options_.shared_token.empty() ? "no agent token" : "a shared agent token",
      client_certificates ? ", certificate binding off" : ", no client certificates",
      "): any agent may report as any id; use --agent-tokens-file or mutual TLS");
}

absl::StatusOr<std::map<std::string, std::string>> ReadAgentTokensFile(const std::string& path) {
  RETURN_IF_ERROR(rpc::CheckSecretFileMode(path, "agent tokens"));
  std::ifstream in(path);
  if (!in)
    return absl::InvalidArgumentError(absl::StrCat("agent tokens file ", path, ": cannot read it"));
  std::map<std::string, std::string> tokens;
  std::set<std::string> seen_tokens;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    const std::string where = absl::StrCat(path, ":", number);
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text.front() == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2)
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected 'AGENT_ID TOKEN', got ", fields.size(), " field(s)"));
    const std::string id(fields[0]), token(fields[1]);
    if (!ValidAgentId(id))
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": agent id '", id.substr(0, kMaxAgentIdLength),
                       "' is not 1..128 characters of [A-Za-z0-9._:-]"));
    // The token itself is never echoed.
    if (token.size() < kMinAgentTokenLength)
      return absl::InvalidArgumentError(absl::StrCat(where, ": the token of '", id, "' has ",
                                                     token.size(), " characters; at least ",
                                                     kMinAgentTokenLength, " are required"));
    if (tokens.count(id))
      return absl::InvalidArgumentError(absl::StrCat(where, ": agent id '", id, "' given twice"));
    if (!seen_tokens.insert(token).second)
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": the token of '", id, "' is another agent's too; each agent needs its own"));
    tokens[id] = token;
  }
  if (in.bad())
    return absl::InvalidArgumentError(absl::StrCat("agent tokens file ", path, ": cannot read it"));
  if (tokens.empty())
    return absl::InvalidArgumentError(absl::StrCat("agent tokens file ", path, " lists no agent"));
  return tokens;
}

}  // namespace infersweep
