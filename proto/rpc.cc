#include "proto/rpc.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace infersweep::rpc {

absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, " file ", path, ": cannot read it"));
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad())
    return absl::InvalidArgumentError(absl::StrCat(what, " file ", path, ": cannot read it"));
  std::string pem = text.str();
  if (pem.find_first_not_of(" \t\r\n\v\f") == std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat(what, " file ", path, " is empty"));
  return pem;
}

absl::Status CheckSecretFileMode(const std::string& path, const std::string& what) {
  struct stat st {};
  if (stat(path.c_str(), &st) == 0 && (st.st_mode & (S_IROTH | S_IWOTH)) != 0)
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s file %s is readable or writable by other users (mode %04o): chmod o-rwx it "
        "(docs/SECURITY.md)",
        what, path, st.st_mode & 07777));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& tls) {
  if (!tls.server_enabled()) {
    if (!tls.client_ca_file.empty())
      return absl::InvalidArgumentError(
          "a TLS client CA needs a server certificate and key too (--tls-cert, --tls-key)");
    return grpc::InsecureServerCredentials();
  }
  if (tls.cert_file.empty() || tls.key_file.empty())
    return absl::InvalidArgumentError(
        "TLS needs both a server certificate and its private key (--tls-cert, --tls-key)");
  absl::StatusOr<std::string> cert = ReadPemFile(tls.cert_file, "TLS certificate");
  if (!cert.ok()) return cert.status();
  if (auto s = CheckSecretFileMode(tls.key_file, "TLS private key"); !s.ok()) return s;
  absl::StatusOr<std::string> key = ReadPemFile(tls.key_file, "TLS private key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({*std::move(key), *std::move(cert)});
  if (!tls.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPemFile(tls.client_ca_file, "TLS client CA");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
    options.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  } else {
    options.client_certificate_request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::SslServerCredentials(options);
  if (!creds) return absl::InvalidArgumentError("cannot build the TLS server credentials");
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& tls) {
  if (!tls.client_enabled()) return grpc::InsecureChannelCredentials();
  if (tls.cert_file.empty() != tls.key_file.empty())
    return absl::InvalidArgumentError(
        "a TLS client certificate needs its private key and vice versa (--tls-cert, --tls-key)");
  grpc::SslCredentialsOptions options;
  if (!tls.ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPemFile(tls.ca_file, "TLS CA");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
  }
  if (!tls.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPemFile(tls.cert_file, "TLS certificate");
    if (!cert.ok()) return cert.status();
    if (auto s = CheckSecretFileMode(tls.key_file, "TLS private key"); !s.ok()) return s;
    absl::StatusOr<std::string> key = ReadPemFile(tls.key_file, "TLS private key");
    if (!key.ok()) return key.status();
    options.pem_cert_chain = *std::move(cert);
    options.pem_private_key = *std::move(key);
  }
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::SslCredentials(options);
  if (!creds) return absl::InvalidArgumentError("cannot build the TLS channel credentials");
  return creds;
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           std::shared_ptr<grpc::ChannelCredentials> credentials,
                                           const std::string& server_name_override) {
  grpc::ChannelArguments args;
  if (!server_name_override.empty()) args.SetSslTargetNameOverride(server_name_override);
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Reconnect quickly after a coordinator restart; the agent has its own backoff on top.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // Notice a coordinator that vanished without closing the connection (host down, cable cut).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  if (!credentials) credentials = grpc::InsecureChannelCredentials();
  return grpc::CreateCustomChannel(address, credentials, args);
}

void ConfigureServer(grpc::ServerBuilder& builder) {
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  // Accept the clients' keepalive pings, and ping quiet agents to notice dead ones.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             kKeepaliveTimeMs / 2);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 3 * kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i)
    diff = diff | (static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]));
  return diff == 0;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  if (auto s = CheckSecretFileMode(path, "token"); !s.ok()) return s;
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("token file ", path, ": cannot read it"));
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad())
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, ": cannot read it"));
  std::string token = text.str();
  while (!token.empty() && (token.back() == ' ' || token.back() == '\t' || token.back() == '\n' ||
                            token.back() == '\r' || token.back() == '\v' || token.back() == '\f'))
    token.pop_back();
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("token file ", path, " is empty"));
  return token;
}

// absl and gRPC share the canonical code numbering (google.rpc.Code).
grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace infersweep::rpc
