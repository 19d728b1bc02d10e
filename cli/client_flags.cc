#include "cli/client_flags.h"

#include <cctype>
#include <cstdlib>
#include <utility>

#include "api/status_macros.h"

namespace infersweep::cli {
namespace {

std::string g_token_file;
rpc::TlsOptions g_client_tls;

}  // namespace

std::string DefaultCoordinator() {
  const char* env = std::getenv("INFERSWEEP_COORDINATOR");
  return env && *env ? env : "127.0.0.1:7070";
}

absl::StatusOr<std::string> UserToken() {
  if (!g_token_file.empty()) return rpc::ReadTokenFile(g_token_file);
  const char* env = std::getenv("INFERSWEEP_USER_TOKEN");
  std::string token = env ? env : "";
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  return token;
}

const rpc::TlsOptions& ClientTls() { return g_client_tls; }

absl::StatusOr<ServiceClient> UserClient(const std::string& coordinator, int64_t timeout_ms) {
  ASSIGN_OR_RETURN(std::string token, UserToken());
  return ServiceClient(coordinator, timeout_ms, std::move(token), ClientTls());
}

void AddUserClientFlags(CLI::App* cmd) {
  cmd->add_option("--token-file", g_token_file,
                  "file holding the user token (default: the token in $INFERSWEEP_USER_TOKEN, "
                  "if set)");
  cmd->add_option("--tls-ca", g_client_tls.ca_file,
                  "PEM CA that verifies the coordinator's certificate (turns TLS on)");
  cmd->add_option("--tls-cert", g_client_tls.cert_file,
                  "PEM client certificate, for a coordinator that requires mutual TLS");
  cmd->add_option("--tls-key", g_client_tls.key_file, "PEM private key of --tls-cert");
}

}  // namespace infersweep::cli
