// Safetensors parser, memory map and writer: a round trip, then one test per validation rule.
#include "engine/safetensors.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include "engine/safetensors_writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;

constexpr char kFile[] = "model.safetensors";
constexpr char kTensor[] = "model.layers.0.mlp.gate.weight";

std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + 31 * i);
  return v;
}

// A file image: length prefix, `header` verbatim, then `data_bytes` bytes of data.
std::vector<uint8_t> Image(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> out(8 + header.size() + data_bytes, 0xAB);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

absl::StatusOr<SafetensorsHeader> Parse(const std::vector<uint8_t>& image) {
  return ParseSafetensorsHeader(image.data(), image.size(), kFile);
}

// One well-formed entry for kTensor, with fields overridable as raw JSON.
std::string Entry(const std::string& dtype = "\"U8\"", const std::string& shape = "[4]",
                  const std::string& offsets = "[0, 4]") {
  return "{\"dtype\": " + dtype + ", \"shape\": " + shape + ", \"data_offsets\": " + offsets + "}";
}

std::string OneTensor(const std::string& entry) {
  return std::string("{\"") + kTensor + "\": " + entry + "}";
}

class SafetensorsFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "safetensors_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  std::string dir_;
};

TEST_F(SafetensorsFileTest, RoundTripThroughWriter) {
  const std::vector<uint8_t> a = Pattern(2 * 3 * 4, 1);  // F32 [2, 3]
  const std::vector<uint8_t> b = Pattern(5 * 2, 2);      // BF16 [5]
  const std::vector<uint8_t> c = Pattern(1, 3);          // BOOL scalar
  const std::vector<uint8_t> empty;                      // I64 [0, 7]
  const std::vector<SafetensorsTensorToWrite> tensors = {
      {"w.a", DType::kF32, {2, 3}, a},
      {"w.b", DType::kBF16, {5}, b},
      {"w.c", DType::kBool, {}, c},
      {"w.empty", DType::kI64, {0, 7}, empty},
  };
  const std::string path = Path(kFile);
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"format", "pt"}}).ok());

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const SafetensorsHeader& h = (*f)->header();
  EXPECT_EQ(h.data_offset % 8, 0u) << "header must be space-padded to a multiple of 8";
  EXPECT_EQ(h.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(h.tensors.size(), 4u);
  for (size_t i = 1; i < h.tensors.size(); ++i) {
    EXPECT_LE(h.tensors[i - 1].data_begin, h.tensors[i].data_begin) << "sorted by data_begin";
  }
  for (const SafetensorsTensorToWrite& t : tensors) {
    const SafetensorsEntry* e = (*f)->Find(t.name);
    ASSERT_NE(e, nullptr) << t.name;
    EXPECT_EQ(e->name, t.name);
    EXPECT_EQ(e->dtype, t.dtype) << t.name;
    EXPECT_EQ(e->shape, t.shape) << t.name;
    EXPECT_EQ(e->data_end - e->data_begin, t.bytes.size()) << t.name;
    if (!t.bytes.empty()) {
      EXPECT_EQ(std::memcmp((*f)->Data(*e), t.bytes.data(), t.bytes.size()), 0) << t.name;
    }
  }
  EXPECT_EQ((*f)->Find("w.missing"), nullptr);
  EXPECT_EQ((*f)->path(), path);
}

TEST_F(SafetensorsFileTest, NoMetadataMeansEmptyMap) {
  const std::vector<uint8_t> a = Pattern(4, 1);
  ASSERT_TRUE(WriteSafetensors(Path(kFile), {{"x", DType::kU8, {4}, a}}).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(Path(kFile));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE((*f)->header().metadata.empty());
}

TEST(SafetensorsWriter, RejectsInconsistentTensors) {
  const std::vector<uint8_t> three = Pattern(3, 0);
  const std::vector<uint8_t> four = Pattern(4, 0);
  // 3 bytes cannot be a BF16 [2].
  absl::StatusOr<std::vector<uint8_t>> r =
      EncodeSafetensorsHeader({{"t", DType::kBF16, {2}, three}});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("'t'"));
  EXPECT_FALSE(EncodeSafetensorsHeader({{"t", DType::kU8, {4}, four}, {"t", DType::kU8, {4}, four}})
                   .ok());
  EXPECT_FALSE(EncodeSafetensorsHeader({{"__metadata__", DType::kU8, {4}, four}}).ok());
  EXPECT_FALSE(EncodeSafetensorsHeader({{"", DType::kU8, {4}, four}}).ok());
  EXPECT_FALSE(EncodeSafetensorsHeader({{"t", DType::kU8, {-4}, four}}).ok());
  EXPECT_TRUE(EncodeSafetensorsHeader({{"t", DType::kU8, {2, 2}, four}}).ok());
}

TEST(SafetensorsWriter, HeaderIsPaddedWithSpaces) {
  const std::vector<uint8_t> a = Pattern(4, 1);
  for (const std::string name : {"a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg", "abcdefgh"}) {
    absl::StatusOr<std::vector<uint8_t>> h = EncodeSafetensorsHeader({{name, DType::kU8, {4}, a}});
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(h->size() % 8, 0u) << name;
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>((*h)[i]) << (8 * i);
    EXPECT_EQ(n + 8, h->size());
    EXPECT_EQ((*h)[8], '{');
    const std::string text(h->begin() + 8, h->end());
    EXPECT_EQ(text.find_last_not_of(' '), text.find_last_of('}')) << "only spaces after '}'";
  }
}

TEST(SafetensorsDTypeNames, RoundTripAndRejectUnknown) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E8M0,
                  DType::kU8, DType::kI8, DType::kI32, DType::kI64, DType::kBool}) {
    EXPECT_EQ(DTypeFromSafetensorsName(DTypeName(t)), t) << DTypeName(t);
  }
  EXPECT_EQ(DTypeName(DType::kF8E4M3), "F8_E4M3");
  EXPECT_EQ(DTypeName(DType::kF8E8M0), "F8_E8M0");
  EXPECT_EQ(DTypeName(DType::kBool), "BOOL");
  EXPECT_FALSE(DTypeFromSafetensorsName("f32").has_value());
  EXPECT_FALSE(DTypeFromSafetensorsName("F64").has_value());
  EXPECT_FALSE(DTypeFromSafetensorsName("").has_value());
}

// ---- header validation, one rule per case ----

struct BadHeaderCase {
  std::string label;
  std::string header;
  size_t data_bytes;
  std::string expect;  // substring of the message besides the file and tensor names
  bool names_tensor = true;
};

// Keeps ctest names readable (gtest_discover_tests appends the printed parameter).
void PrintTo(const BadHeaderCase& c, std::ostream* os) { *os << c.label; }

class SafetensorsBadHeaderTest : public ::testing::TestWithParam<BadHeaderCase> {};

TEST_P(SafetensorsBadHeaderTest, RejectedWithFileAndTensorNamed) {
  const BadHeaderCase& c = GetParam();
  absl::StatusOr<SafetensorsHeader> h = Parse(Image(c.header, c.data_bytes));
  ASSERT_FALSE(h.ok()) << c.label << ": accepted " << c.header;
  const std::string msg(h.status().message());
  EXPECT_THAT(msg, HasSubstr(kFile));
  if (c.names_tensor) {
    EXPECT_THAT(msg, HasSubstr(std::string("'") + kTensor + "'"));
  }
  EXPECT_THAT(msg, HasSubstr(c.expect));
}

const std::string kOther = "\"other\": " + Entry("\"U8\"", "[4]", "[4, 8]");

INSTANTIATE_TEST_SUITE_P(
    Rules, SafetensorsBadHeaderTest,
    ::testing::Values(
        BadHeaderCase{"EntryNotObject", OneTensor("[1, 2]"), 4, "must be an object"},
        BadHeaderCase{"MissingDtype", OneTensor("{\"shape\": [4], \"data_offsets\": [0, 4]}"), 4,
                      "missing \"dtype\""},
        BadHeaderCase{"DtypeNotString", OneTensor(Entry("7")), 4, "\"dtype\" must be a string"},
        BadHeaderCase{"UnknownDtype", OneTensor(Entry("\"F4\"")), 4, "unknown dtype 'F4'"},
        BadHeaderCase{"LowercaseDtype", OneTensor(Entry("\"u8\"")), 4, "unknown dtype 'u8'"},
        BadHeaderCase{"MissingShape", OneTensor("{\"dtype\": \"U8\", \"data_offsets\": [0, 4]}"), 4,
                      "missing \"shape\""},
        BadHeaderCase{"ShapeNotArray", OneTensor(Entry("\"U8\"", "4")), 4,
                      "\"shape\" must be an array"},
        BadHeaderCase{"ShapeFloat", OneTensor(Entry("\"U8\"", "[4.0]")), 4, "must be an integer"},
        BadHeaderCase{"ShapeString", OneTensor(Entry("\"U8\"", "[\"4\"]")), 4,
                      "must be an integer"},
        BadHeaderCase{"NegativeDim", OneTensor(Entry("\"U8\"", "[-4]")), 4, "negative"},
        BadHeaderCase{"DimBeyondInt64", OneTensor(Entry("\"U8\"", "[18446744073709551615]")), 4,
                      "too large"},
        BadHeaderCase{"NumelOverflow", OneTensor(Entry("\"U8\"", "[4294967296, 4294967296, 4]")), 4,
                      "overflows"},
        BadHeaderCase{"ByteSizeOverflow", OneTensor(Entry("\"F32\"", "[4611686018427387904]")), 4,
                      "overflows"},
        BadHeaderCase{"MissingOffsets", OneTensor("{\"dtype\": \"U8\", \"shape\": [4]}"), 4,
                      "missing \"data_offsets\""},
        BadHeaderCase{"OffsetsThreeElements", OneTensor(Entry("\"U8\"", "[4]", "[0, 4, 8]")), 8,
                      "[begin, end]"},
        BadHeaderCase{"OffsetsNotArray", OneTensor(Entry("\"U8\"", "[4]", "{\"a\": 0}")), 8,
                      "[begin, end]"},
        BadHeaderCase{"OffsetNegative", OneTensor(Entry("\"U8\"", "[4]", "[-4, 0]")), 8,
                      "[begin, end]"},
        BadHeaderCase{"OffsetFloat", OneTensor(Entry("\"U8\"", "[4]", "[0, 4.5]")), 8,
                      "[begin, end]"},
        BadHeaderCase{"OffsetBeyondU64",
                      OneTensor(Entry("\"U8\"", "[4]", "[0, 99999999999999999999999]")), 8,
                      "[begin, end]"},
        BadHeaderCase{"BeginAfterEnd", OneTensor(Entry("\"U8\"", "[0]", "[8, 4]")), 8,
                      "begin > end"},
        BadHeaderCase{"EndPastData", OneTensor(Entry("\"U8\"", "[10]", "[10, 20]")), 15,
                      "model.safetensors: tensor 'model.layers.0.mlp.gate.weight': data_offsets "
                      "[10, 20] end past data section of 15 bytes"},
        BadHeaderCase{
            "HugeOffsets",
            OneTensor(Entry("\"U8\"", "[4]", "[18446744073709551612, 18446744073709551615]")), 8,
            "end past data section"},
        BadHeaderCase{"ByteLengthMismatch", OneTensor(Entry("\"BF16\"", "[4]", "[0, 4]")), 8,
                      "span 4 bytes but BF16 [4] needs 8"},
        BadHeaderCase{"Overlap",
                      "{\"other\": " + Entry("\"U8\"", "[4]", "[0, 4]") + ", \"" + kTensor +
                          "\": " + Entry("\"U8\"", "[4]", "[2, 6]") + "}",
                      8, "overlap tensor 'other' [0, 4]"},
        BadHeaderCase{"SameRange",
                      "{\"other\": " + Entry("\"U8\"", "[4]", "[0, 4]") + ", \"" + kTensor +
                          "\": " + Entry("\"U8\"", "[2, 2]", "[0, 4]") + "}",
                      8, "overlap"},
        BadHeaderCase{"DuplicateName",
                      "{\"" + std::string(kTensor) + "\": " + Entry() + ", \"" + kTensor +
                          "\": " + Entry("\"U8\"", "[4]", "[4, 8]") + "}",
                      8, "more than once"},
        BadHeaderCase{"MalformedJson", "{\"" + std::string(kTensor) + "\": {\"dtype\": ", 8,
                      "not valid JSON", /*names_tensor=*/false},
        BadHeaderCase{"TrailingGarbage", OneTensor(Entry()) + "}", 4, "not valid JSON",
                      /*names_tensor=*/false},
        BadHeaderCase{"EmptyHeader", "", 4, "not valid JSON", /*names_tensor=*/false},
        // nlohmann reports a float overflow as out_of_range, not parse_error.
        BadHeaderCase{"NumberOverflow", OneTensor(Entry("\"U8\"", "[1e400]")), 4, "not valid JSON",
                      /*names_tensor=*/false},
        BadHeaderCase{"DeepNesting",
                      OneTensor(Entry("\"U8\"", std::string(65, '[') + "4" + std::string(65, ']'))),
                      4, "JSON nested deeper than 64 levels", /*names_tensor=*/false},
        BadHeaderCase{"TopLevelArray", "[" + Entry() + "]", 4, "must be a JSON object",
                      /*names_tensor=*/false},
        BadHeaderCase{"MetadataNotObject", "{\"__metadata__\": [\"pt\"], " + kOther + "}", 8,
                      "\"__metadata__\" must be an object", /*names_tensor=*/false},
        BadHeaderCase{"MetadataValueNotString",
                      "{\"__metadata__\": {\"format\": 1}, " + kOther + "}", 8,
                      "value for 'format' must be a string", /*names_tensor=*/false}),
    [](const ::testing::TestParamInfo<BadHeaderCase>& info) { return info.param.label; });

TEST(SafetensorsHeader, AcceptsPaddingGapsAndEmptyTensors) {
  // Trailing spaces, an unused gap between tensors, and an empty tensor sharing an offset.
  const std::string header = "{\"a\": " + Entry("\"U8\"", "[4]", "[0, 4]") +
                             ", \"gap\": " + Entry("\"U8\"", "[2]", "[6, 8]") +
                             ", \"e\": " + Entry("\"F32\"", "[0, 3]", "[2, 2]") +
                             ", \"__metadata__\": {\"format\": \"pt\"}}      ";
  absl::StatusOr<SafetensorsHeader> h = Parse(Image(header, 8));
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors.size(), 3u);
  EXPECT_EQ(h->data_offset, 8 + header.size());
  EXPECT_EQ(h->tensors[0].name, "a");
  EXPECT_EQ(h->tensors[1].name, "e");
  EXPECT_EQ(h->tensors[2].name, "gap");
  EXPECT_EQ(h->metadata.at("format"), "pt");
}

TEST(SafetensorsHeader, ShorterThanLengthPrefix) {
  const std::vector<uint8_t> tiny = {1, 2, 3};
  absl::StatusOr<SafetensorsHeader> h = Parse(tiny);
  ASSERT_FALSE(h.ok());
  EXPECT_THAT(h.status().message(), HasSubstr(kFile));
  EXPECT_THAT(h.status().message(), HasSubstr("too short"));
  EXPECT_FALSE(ParseSafetensorsHeader(nullptr, 0, kFile).ok());
}

TEST(SafetensorsHeader, HeaderLengthBeyondFile) {
  std::vector<uint8_t> image = Image(OneTensor(Entry()), 4);
  image[0] = 0xE8;  // claim a 1000-byte header
  image[1] = 0x03;
  absl::StatusOr<SafetensorsHeader> h = Parse(image);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(h.status().message(), HasSubstr(kFile));
  EXPECT_THAT(h.status().message(), HasSubstr("header length 1000 runs past the end"));
}

TEST(SafetensorsHeader, HeaderLengthOverLimit) {
  std::vector<uint8_t> image = Image(OneTensor(Entry()), 4);
  for (int i = 0; i < 8; ++i) image[i] = 0xFF;  // 2^64 - 1
  absl::StatusOr<SafetensorsHeader> h = Parse(image);
  ASSERT_FALSE(h.ok());
  EXPECT_THAT(h.status().message(), HasSubstr("exceeds the limit"));
}

TEST(SafetensorsHeader, DataLossForOffsetsPastEnd) {
  absl::StatusOr<SafetensorsHeader> h = Parse(Image(OneTensor(Entry()), 3));
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(SafetensorsFileTest, TruncatedFileIsRejected) {
  const std::vector<uint8_t> a = Pattern(64, 1);
  const std::vector<uint8_t> b = Pattern(32, 2);
  const std::string good = Path("good.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(good, {{"a", DType::kF32, {16}, a}, {kTensor, DType::kBF16, {16}, b}})
          .ok());
  const uintmax_t size = std::filesystem::file_size(good);
  ASSERT_TRUE(SafetensorsFile::Open(good).ok());
  // Cut inside the last tensor, at the data boundary, inside the header, inside the prefix.
  for (uintmax_t cut : {uintmax_t{1}, uintmax_t{31}, uintmax_t{96}, size - 12, size - 4}) {
    const std::string path = Path("cut.safetensors");
    std::filesystem::copy_file(good, path, std::filesystem::copy_options::overwrite_existing);
    std::filesystem::resize_file(path, size - cut);
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
    ASSERT_FALSE(f.ok()) << "cut " << cut;
    EXPECT_THAT(f.status().message(), HasSubstr("cut.safetensors")) << "cut " << cut;
  }
  // Truncating into the data names the tensor that lost bytes.
  const std::string path = Path("cut.safetensors");
  std::filesystem::copy_file(good, path, std::filesystem::copy_options::overwrite_existing);
  std::filesystem::resize_file(path, size - 1);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(f.status().message(), HasSubstr(kTensor));
}

TEST_F(SafetensorsFileTest, EmptyFile) {
  const std::string path = Path("empty.safetensors");
  std::ofstream(path).close();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(f.status().message(), HasSubstr(path));
  EXPECT_THAT(f.status().message(), HasSubstr("empty file"));
}

TEST_F(SafetensorsFileTest, MissingFile) {
  const std::string path = Path("nope.safetensors");
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(f.status().message(), HasSubstr(path));
  EXPECT_EQ(MappedFile::Open(path).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SafetensorsFileTest, DirectoryIsNotAFile) {
  absl::StatusOr<std::unique_ptr<MappedFile>> m = MappedFile::Open(dir_);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr(dir_));
}

TEST_F(SafetensorsFileTest, MappedFileSeesFileBytes) {
  const std::string path = Path("raw.bin");
  {
    std::ofstream out(path, std::ios::binary);
    out << "hello";
  }
  absl::StatusOr<std::unique_ptr<MappedFile>> m = MappedFile::Open(path);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ((*m)->size(), 5u);
  EXPECT_EQ(std::memcmp((*m)->data(), "hello", 5), 0);
  EXPECT_EQ((*m)->path(), path);
}

TEST_F(SafetensorsFileTest, OpenReportsHeaderErrorsWithPath) {
  const std::string path = Path("bad.safetensors");
  const std::vector<uint8_t> image = Image(OneTensor(Entry("\"Q4\"")), 4);
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(image.data()), static_cast<std::streamsize>(image.size()));
  }
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(f.status().message(), HasSubstr("bad.safetensors"));
  EXPECT_THAT(f.status().message(), HasSubstr(kTensor));
  EXPECT_THAT(f.status().message(), HasSubstr("unknown dtype 'Q4'"));
}

}  // namespace
}  // namespace infersweep
