// What every command that talks to a coordinator shares: the default address, the user token
// and the client's TLS settings, and the flags that set them (docs/SERVICE.md).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "absl/status/statusor.h"
#include "proto/rpc.h"

namespace infersweep::cli {

// $INFERSWEEP_COORDINATOR, else 127.0.0.1:7070.
std::string DefaultCoordinator();

// The user token the command sends: --token-file, else $INFERSWEEP_USER_TOKEN (trailing
// whitespace stripped), else none.
absl::StatusOr<std::string> UserToken();

// TLS of the command (--tls-ca, --tls-cert, --tls-key).
const rpc::TlsOptions& ClientTls();

// --token-file and the TLS flags (only one command runs per process, so they are shared).
void AddUserClientFlags(CLI::App* cmd);

}  // namespace infersweep::cli
