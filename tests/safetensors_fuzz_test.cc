// Seeded mutation fuzzing of ParseSafetensorsHeader.
//
// Valid files are mutated (bit flips, truncation, inserted JSON tokens, spliced ranges, random
// length prefixes, huge numbers) and parsed. Every result must be either an error with a
// message naming the file, or a header whose invariants hold, so that callers can trust it:
// each tensor lies inside the data section, tensors do not overlap, and byte lengths match.
//
// INFERSWEEP_FUZZ_SECONDS (default 5) bounds the run time, kMaxIterations the work;
// INFERSWEEP_FUZZ_SEED replaces the fixed seed to explore further.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine/safetensors.h"
#include "engine/safetensors_writer.h"
#include "gtest/gtest.h"

namespace infersweep {
namespace {

constexpr char kFile[] = "fuzz.safetensors";
constexpr uint64_t kDefaultSeed = 0x5afe7e50f5eedull;
constexpr int64_t kMaxIterations = 2'000'000;

using Bytes = std::vector<uint8_t>;

uint64_t HeaderLength(const Bytes& image) {
  uint64_t n = 0;
  for (int i = 0; i < 8 && i < static_cast<int>(image.size()); ++i) {
    n |= static_cast<uint64_t>(image[i]) << (8 * i);
  }
  return n;
}

void SetHeaderLength(Bytes& image, uint64_t n) {
  if (image.size() < 8) image.resize(8);
  for (int i = 0; i < 8; ++i) image[i] = static_cast<uint8_t>(n >> (8 * i));
}

Bytes Encode(const std::vector<SafetensorsTensorToWrite>& tensors,
             const std::map<std::string, std::string>& metadata = {}) {
  absl::StatusOr<Bytes> header = EncodeSafetensorsHeader(tensors, metadata);
  EXPECT_TRUE(header.ok()) << header.status();
  Bytes image = header.ok() ? *header : Bytes{};
  for (const SafetensorsTensorToWrite& t : tensors) {
    image.insert(image.end(), t.bytes.begin(), t.bytes.end());
  }
  return image;
}

Bytes Raw(const std::string& json, size_t data_bytes) {
  Bytes image(8);
  SetHeaderLength(image, json.size());
  image.insert(image.end(), json.begin(), json.end());
  image.resize(image.size() + data_bytes, 0x5A);
  return image;
}

std::vector<Bytes> Seeds() {
  const Bytes a(2 * 3 * 4, 1), b(4 * 2, 2), c(5, 3), d(2 * 8, 4);
  const Bytes none;
  return {
      Encode({{"model.embed_tokens.weight", DType::kF32, {2, 3}, a},
              {"model.layers.0.mlp.gate.weight", DType::kBF16, {2, 2}, b},
              {"mask", DType::kBool, {5}, c},
              {"ids", DType::kI64, {2}, d}},
             {{"format", "pt"}}),
      Encode({{"x", DType::kU8, {5}, c}}),
      Encode({{"empty", DType::kF16, {0, 4}, none}, {"y", DType::kI8, {5}, c}}),
      Raw(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
          R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},)"
          R"("__metadata__":{"k":"v"}}    )",
          12),
  };
}

const char* const kTokens[] = {
    "{", "}", "[", "]", ",", ":", "\"", " ", "0", "1", "-1", "-0", "1.5", "1e400", "-1e400",
    "4294967296", "9223372036854775807", "9223372036854775808", "-9223372036854775808",
    "18446744073709551615", "18446744073709551616", "99999999999999999999999999", "null",
    "true", "false", "\"\"", "\"F32\"", "\"BF16\"", "\"F8_E4M3\"", "\"BOOL\"", "\"dtype\"",
    "\"shape\"", "\"data_offsets\"", "\"__metadata__\"", "[0,0]", "[0,18446744073709551615]",
    "[]", "{}", "\"\\u0000\"", "\"\\ud800\"", "\xff", "\xc3\x28", "\"x\":", "[[[[[[[[", "]]]]]]]]",
};

const char* const kNumbers[] = {
    "0", "1", "2", "3", "4", "7", "8", "-1", "65535", "4294967295", "4294967296",
    "9223372036854775807", "9223372036854775808", "18446744073709551615",
    "18446744073709551616", "1e19", "2.0",
};

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  size_t Below(size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }
  bool Chance(int percent) { return Below(100) < static_cast<size_t>(percent); }

  void Mutate(Bytes& image) {
    const int rounds = 1 + static_cast<int>(Below(3));
    for (int r = 0; r < rounds; ++r) MutateOnce(image);
  }

 private:
  // The JSON region [8, 8 + N) clipped to the image; edits there usually keep N consistent so
  // the parser gets past the length check and exercises the JSON and entry validation.
  size_t HeaderEnd(const Bytes& image) const {
    const uint64_t n = HeaderLength(image);
    return image.size() < 8 ? image.size() : 8 + std::min<uint64_t>(n, image.size() - 8);
  }

  void Resize(Bytes& image, size_t pos, size_t erase, const std::string& insert) {
    const bool in_header = image.size() >= 8 && pos >= 8 && pos <= HeaderEnd(image);
    image.erase(image.begin() + pos, image.begin() + pos + erase);
    image.insert(image.begin() + pos, insert.begin(), insert.end());
    if (in_header && !Chance(5)) {
      SetHeaderLength(image, HeaderLength(image) + insert.size() - erase);
    }
  }

  void MutateOnce(Bytes& image) {
    const size_t header_end = HeaderEnd(image);
    const size_t header_size = header_end > 8 ? header_end - 8 : 0;
    switch (Below(10)) {
      case 0: {  // flip bits anywhere
        if (image.empty()) return;
        for (size_t k = 1 + Below(4); k > 0; --k) {
          image[Below(image.size())] ^= static_cast<uint8_t>(1u << Below(8));
        }
        break;
      }
      case 1:  // truncate
        image.resize(Below(image.size() + 1));
        break;
      case 2: {  // insert a JSON token inside the header
        if (image.size() < 8) return;
        Resize(image, 8 + Below(header_size + 1), 0, kTokens[Below(std::size(kTokens))]);
        break;
      }
      case 3: {  // delete a range of the header
        if (header_size == 0) return;
        const size_t pos = 8 + Below(header_size);
        Resize(image, pos, 1 + Below(std::min<size_t>(header_end - pos, 16)), "");
        break;
      }
      case 4: {  // replace a number in the header with an edge value
        std::vector<std::pair<size_t, size_t>> runs;  // [begin, end) of digit runs
        for (size_t i = 8; i < header_end;) {
          if (image[i] >= '0' && image[i] <= '9') {
            size_t j = i;
            while (j < header_end && image[j] >= '0' && image[j] <= '9') ++j;
            runs.push_back({i, j});
            i = j;
          } else {
            ++i;
          }
        }
        if (runs.empty()) return;
        const auto [b, e] = runs[Below(runs.size())];
        Resize(image, b, e - b, kNumbers[Below(std::size(kNumbers))]);
        break;
      }
      case 5: {  // random or near-miss length prefix
        const uint64_t n = HeaderLength(image);
        const uint64_t choices[] = {rng_(),
                                    n + 1,
                                    n - 1,
                                    n + Below(64),
                                    image.size() >= 8 ? image.size() - 8 : 0,
                                    image.size() - Below(16),
                                    100ull << 20,
                                    (100ull << 20) + 1,
                                    ~0ull};
        SetHeaderLength(image, choices[Below(std::size(choices))]);
        break;
      }
      case 6: {  // splice a copy of one header range somewhere else in it
        if (header_size == 0) return;
        const size_t from = 8 + Below(header_size);
        const size_t len = 1 + Below(std::min<size_t>(header_end - from, 48));
        const std::string piece(image.begin() + from, image.begin() + from + len);
        Resize(image, 8 + Below(header_size + 1), 0, piece);
        break;
      }
      case 7: {  // grow or shrink the data section
        if (Chance(50)) {
          image.resize(image.size() + 1 + Below(16), 0x77);
        } else if (image.size() > header_end) {
          image.resize(image.size() - 1 - Below(std::min<size_t>(image.size() - header_end, 8)));
        }
        break;
      }
      case 8: {  // overwrite a header byte with a structural character
        if (header_size == 0) return;
        static const char kChars[] = "{}[],:\"-0123456789eE. \\";
        image[8 + Below(header_size)] = static_cast<uint8_t>(kChars[Below(sizeof kChars - 1)]);
        break;
      }
      case 9: {  // move one tensor's range, keeping its length, so that ranges can collide
        if (header_size == 0) return;
        const std::string text(image.begin() + 8, image.begin() + header_end);
        static const std::string kKey = "\"data_offsets\":[";
        std::vector<size_t> found;
        for (size_t p = text.find(kKey); p != std::string::npos; p = text.find(kKey, p + 1)) {
          found.push_back(p + kKey.size());
        }
        if (found.empty()) return;
        const size_t start = found[Below(found.size())];
        const size_t close = text.find(']', start);
        if (close == std::string::npos) return;
        unsigned long long begin = 0, end = 0;
        if (std::sscanf(text.c_str() + start, "%llu,%llu", &begin, &end) != 2 || end < begin) {
          return;
        }
        const unsigned long long to = Below(end + 8);
        Resize(image, 8 + start, close - start,
               std::to_string(to) + "," + std::to_string(to + (end - begin)));
        break;
      }
    }
  }

  std::mt19937_64 rng_;
};

std::string Printable(const uint8_t* p, size_t n) {
  std::string s;
  for (size_t i = 0; i < n && i < 600; ++i) {
    const char c = static_cast<char>(p[i]);
    if (c >= 32 && c < 127) {
      s += c;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", p[i]);
      s += buf;
    }
  }
  return s;
}

// Checks everything a caller relies on; returns "" or a description of the first violation.
std::string CheckInvariants(const SafetensorsHeader& h, const uint8_t* bytes, size_t size) {
  if (size < 8) return "accepted a file shorter than 8 bytes";
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  if (h.data_offset != 8 + n) return "data_offset != 8 + header length";
  if (h.data_offset > size) return "data section starts past the end of the file";
  const uint64_t data_size = size - h.data_offset;
  std::set<std::string> names;
  const SafetensorsEntry* prev_nonempty = nullptr;
  uint64_t prev_begin = 0;
  unsigned checksum = 0;
  for (const SafetensorsEntry& t : h.tensors) {
    if (!names.insert(t.name).second) return "duplicate tensor " + t.name;
    if (t.data_begin < prev_begin) return "tensors not sorted by data_begin";
    prev_begin = t.data_begin;
    if (t.data_begin > t.data_end) return "begin > end for " + t.name;
    if (t.data_end > data_size) return "tensor past the data section: " + t.name;
    unsigned __int128 numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return "negative dimension in " + t.name;
      numel *= static_cast<uint64_t>(d);
      if (numel > (static_cast<unsigned __int128>(1) << 64)) return "numel overflow in " + t.name;
    }
    if (numel * DTypeSize(t.dtype) != t.data_end - t.data_begin) {
      return "byte length != numel * dtype size for " + t.name;
    }
    if (t.data_begin == t.data_end) continue;
    if (prev_nonempty != nullptr && t.data_begin < prev_nonempty->data_end) {
      return "overlap between " + prev_nonempty->name + " and " + t.name;
    }
    prev_nonempty = &t;
    // Touch the first and last byte, as a consumer would (caught by ASan if out of bounds).
    const uint8_t* data = bytes + h.data_offset;
    checksum += data[t.data_begin] + data[t.data_end - 1];
  }
  volatile unsigned sink = checksum;
  (void)sink;
  return "";
}

TEST(SafetensorsFuzz, SeedsAreValid) {
  for (const Bytes& seed : Seeds()) {
    absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(seed.data(), seed.size(), kFile);
    ASSERT_TRUE(h.ok()) << h.status() << "\n" << Printable(seed.data(), seed.size());
    EXPECT_EQ(CheckInvariants(*h, seed.data(), seed.size()), "");
  }
}

TEST(SafetensorsFuzz, MutatedHeadersNeverBreakInvariants) {
  double seconds = 5;
  if (const char* env = std::getenv("INFERSWEEP_FUZZ_SECONDS")) seconds = std::atof(env);
  uint64_t seed = kDefaultSeed;
  if (const char* env = std::getenv("INFERSWEEP_FUZZ_SEED")) seed = std::strtoull(env, nullptr, 0);

  const std::vector<Bytes> seeds = Seeds();
  Mutator mutator(seed);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(seconds));
  int64_t iterations = 0, accepted = 0, rejected = 0;
  for (; iterations < kMaxIterations; ++iterations) {
    if (iterations % 256 == 0 && std::chrono::steady_clock::now() >= deadline) break;
    Bytes image = seeds[mutator.Below(seeds.size())];
    mutator.Mutate(image);
    // An exact-size copy, so that any read past the end leaves the allocation.
    const size_t size = image.size();
    std::unique_ptr<uint8_t[]> buf(size == 0 ? nullptr : new uint8_t[size]);
    if (size != 0) std::memcpy(buf.get(), image.data(), size);

    absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(buf.get(), size, kFile);
    if (h.ok()) {
      ++accepted;
      const std::string broken = CheckInvariants(*h, buf.get(), size);
      ASSERT_EQ(broken, "") << "iteration " << iterations << " seed " << seed << "\ninput: "
                            << Printable(buf.get(), size);
    } else {
      ++rejected;
      ASSERT_FALSE(h.status().message().empty()) << "iteration " << iterations;
      ASSERT_NE(h.status().message().find(kFile), absl::string_view::npos)
          << "message does not name the file: " << h.status().message();
    }
  }
  std::printf("safetensors fuzz: seed %llu, %lld iterations (%lld accepted, %lld rejected)\n",
              static_cast<unsigned long long>(seed), static_cast<long long>(iterations),
              static_cast<long long>(accepted), static_cast<long long>(rejected));
  // Both outcomes must occur, or the mutations are not exercising the parser.
  if (iterations >= 1000) {
    EXPECT_GT(accepted, 0);
    EXPECT_GT(rejected, 0);
  }
}

}  // namespace
}  // namespace infersweep
