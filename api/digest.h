// SHA-256 (OpenSSL's libcrypto), for content that must be compared without being kept twice: a
// stored result's content (a conflicting duplicate is refused) and a client certificate (an
// agent's credential).
#pragma once

#include <string>
#include <string_view>

namespace infersweep {

// 64 lowercase hex digits.
std::string Sha256Hex(std::string_view bytes);

}  // namespace infersweep
