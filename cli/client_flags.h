// What every command that talks to a coordinator shares: the default address, the user token
// and the client's TLS settings, and the flags that set them (docs/SERVICE.md).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/client.h"
#include "proto/rpc.h"

namespace infersweep::cli {

// $INFERSWEEP_COORDINATOR, else 127.0.0.1:7070.
std::string DefaultCoordinator();

// The user token the command sends: --token-file, else $INFERSWEEP_USER_TOKEN (trailing
// whitespace stripped), else none.
absl::StatusOr<std::string> UserToken();

// TLS of the command (--tls-ca, --tls-cert, --tls-key).
const rpc::TlsOptions& ClientTls();

// A client of the coordinator at `coordinator` with the command's user token and TLS; every call
// fails after `timeout_ms`. Fails where the token file cannot be read.
absl::StatusOr<ServiceClient> UserClient(const std::string& coordinator,
                                         int64_t timeout_ms = 30'000);

// --token-file and the TLS flags (only one command runs per process, so they are shared).
void AddUserClientFlags(CLI::App* cmd);

}  // namespace infersweep::cli
