#include "proto/rpc.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "api/status_macros.h"

namespace infersweep::rpc {

absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::InvalidArgumentError(absl::StrCat(what, " file ", path, ": cannot read it"));
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad())
    return absl::InvalidArgumentError(absl::StrCat(what, " file ", path, ": cannot read it"));
  std::string pem = text.str();
  if (pem.find_first_not_of(" \t\r\n\v\f") == std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat(what, " file ", path, " is empty"));
  return pem;
}

namespace {

// OpenSSL's reason for the last failure on this thread, and the error queue cleared.
std::string OpenSslReason() {
  const unsigned long code = ERR_peek_last_error();
  ERR_clear_error();
  if (code == 0) return "no PEM block found";
  const char* reason = ERR_reason_error_string(code);
  return reason != nullptr ? reason : absl::StrCat("OpenSSL error ", code);
}

using UniqueBio = std::unique_ptr<BIO, decltype(&BIO_free)>;
using UniqueX509 = std::unique_ptr<X509, decltype(&X509_free)>;
using UniqueKey = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;

UniqueBio MemoryBio(const std::string& pem) {
  return UniqueBio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
}

// The certificates of a PEM file, in order; an error naming `what` and `path` when it holds none
// or a damaged one.
absl::StatusOr<std::vector<UniqueX509>> ParseCertificates(const std::string& pem,
                                                          const std::string& what,
                                                          const std::string& path) {
  ERR_clear_error();
  UniqueBio bio = MemoryBio(pem);
  std::vector<UniqueX509> certs;
  while (X509* cert = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr))
    certs.emplace_back(cert, &X509_free);
  // The loop ends at the end of the data (PEM_R_NO_START_LINE) or at a damaged block.
  const unsigned long last = ERR_peek_last_error();
  const bool at_end =
      ERR_GET_LIB(last) == ERR_LIB_PEM && ERR_GET_REASON(last) == PEM_R_NO_START_LINE;
  if (certs.empty() || (last != 0 && !at_end))
    return absl::InvalidArgumentError(
        absl::StrCat(what, " file ", path, " is not a PEM certificate",
                     certs.empty() ? "" : " chain", " (", OpenSslReason(), ")"));
  ERR_clear_error();
  return certs;
}

// A certificate, its key and the pair checked as OpenSSL sees them, so that gRPC never gets a
// pair it cannot use (it would log raw handshake errors and fail to bind, naming no file).
absl::Status CheckCertificateAndKey(const std::string& cert_pem, const std::string& cert_path,
                                    const std::string& key_pem, const std::string& key_path) {
  ASSIGN_OR_RETURN(std::vector<UniqueX509> certs,
                   ParseCertificates(cert_pem, "TLS certificate", cert_path));
  ERR_clear_error();
  UniqueBio bio = MemoryBio(key_pem);
  UniqueKey key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr), &EVP_PKEY_free);
  if (key == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("TLS private key file ", key_path,
                                                   " is not an unencrypted PEM private key (",
                                                   OpenSslReason(), ")"));
  if (X509_check_private_key(certs.front().get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS private key file ", key_path, " does not match the certificate in ", cert_path));
  }
  X509* leaf = certs.front().get();
  if (X509_cmp_current_time(X509_get0_notAfter(leaf)) < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("the TLS certificate in ", cert_path, " has expired"));
  if (X509_cmp_current_time(X509_get0_notBefore(leaf)) > 0)
    return absl::InvalidArgumentError(
        absl::StrCat("the TLS certificate in ", cert_path, " is not valid yet"));
  return absl::OkStatus();
}

}  // namespace

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
  ASSIGN_OR_RETURN(std::string cert, ReadPemFile(tls.cert_file, "TLS certificate"));
  RETURN_IF_ERROR(CheckSecretFileMode(tls.key_file, "TLS private key"));
  ASSIGN_OR_RETURN(std::string key, ReadPemFile(tls.key_file, "TLS private key"));
  RETURN_IF_ERROR(CheckCertificateAndKey(cert, tls.cert_file, key, tls.key_file));
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({std::move(key), std::move(cert)});
  if (!tls.client_ca_file.empty()) {
    ASSIGN_OR_RETURN(std::string ca, ReadPemFile(tls.client_ca_file, "TLS client CA"));
    if (auto certs = ParseCertificates(ca, "TLS client CA", tls.client_ca_file); !certs.ok())
      return certs.status();
    options.pem_root_certs = std::move(ca);
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
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
    ASSIGN_OR_RETURN(std::string ca, ReadPemFile(tls.ca_file, "TLS CA"));
    if (auto certs = ParseCertificates(ca, "TLS CA", tls.ca_file); !certs.ok())
      return certs.status();
    options.pem_root_certs = std::move(ca);
  }
  if (!tls.cert_file.empty()) {
    ASSIGN_OR_RETURN(std::string cert, ReadPemFile(tls.cert_file, "TLS certificate"));
    RETURN_IF_ERROR(CheckSecretFileMode(tls.key_file, "TLS private key"));
    ASSIGN_OR_RETURN(std::string key, ReadPemFile(tls.key_file, "TLS private key"));
    RETURN_IF_ERROR(CheckCertificateAndKey(cert, tls.cert_file, key, tls.key_file));
    options.pem_cert_chain = std::move(cert);
    options.pem_private_key = std::move(key);
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
  RETURN_IF_ERROR(CheckSecretFileMode(path, "token"));
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
  if (token.empty())
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, " is empty"));
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
