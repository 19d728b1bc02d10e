// SHA-256 (OpenSSL's libcrypto), for content that must be compared without being kept twice: a
// stored result's content (a conflicting duplicate is refused) and a client certificate (an
// agent's credential).
#pragma once

#include <string>
#include <string_view>

namespace infersweep {

// The 32 bytes of the digest.
std::string Sha256(std::string_view bytes);
// Lowercase hex of `bytes`.
std::string HexOf(std::string_view bytes);
// HexOf(Sha256(bytes)): 64 hex digits.
inline std::string Sha256Hex(std::string_view bytes) { return HexOf(Sha256(bytes)); }

}  // namespace infersweep
