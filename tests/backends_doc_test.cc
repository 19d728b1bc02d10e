// docs/BACKENDS.md is generated from the backend registry (`infersweep backends --markdown`):
// the checked-in file must equal the generator's output, so a registry change that is not
// regenerated fails here with the first line that differs and the command that fixes it.
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/backends_markdown.h"
#include "api/backend_config.h"
#include "gtest/gtest.h"

namespace infersweep {
namespace {

constexpr char kRegenerate[] = "./build/cli/infersweep backends --markdown > docs/BACKENDS.md";

std::vector<std::string> Lines(const std::string& text) { return absl::StrSplit(text, '\n'); }

TEST(BackendsDocTest, CheckedInFileMatchesTheRegistry) {
  const std::string path = std::string(INFERSWEEP_SOURCE_DIR) + "/docs/BACKENDS.md";
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << "cannot read " << path << "; generate it with: " << kRegenerate;
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string checked_in = buffer.str();
  const std::string generated = cli::BackendsMarkdown();
  if (checked_in == generated) return;

  const std::vector<std::string> want = Lines(generated);
  const std::vector<std::string> have = Lines(checked_in);
  size_t line = 0;
  while (line < want.size() && line < have.size() && want[line] == have[line]) ++line;
  const auto shown = [](const std::vector<std::string>& lines, size_t i) {
    return i < lines.size() ? absl::StrCat("'", lines[i], "'") : std::string("(end of file)");
  };
  ADD_FAILURE() << "docs/BACKENDS.md differs from the registry's output at line " << line + 1
                << ":\n  checked in: " << shown(have, line)
                << "\n  generated:  " << shown(want, line)
                << "\nThe file is generated; do not edit it by hand. Regenerate it with:\n  "
                << kRegenerate;
}

// TEST ONLY rows (test_kernel) are left out: no sweep is meant to list them.
TEST(BackendsDocTest, OneTableRowPerRegistryRow) {
  const std::string md = cli::BackendsMarkdown();
  int test_only = 0;
  for (const BackendDescriptor& d : BackendRegistry()) {
    const std::string row =
        absl::StrCat("| ", d.axis, " | ", d.value, " | ", DeviceName(d.device), " |");
    if (d.test_only) {
      ++test_only;
      EXPECT_EQ(md.find(row), std::string::npos) << "a TEST ONLY row is listed: " << row;
      EXPECT_EQ(cli::BackendsText().find(absl::StrCat(d.axis, "=", d.value, " ")),
                std::string::npos)
          << d.axis << "=" << d.value;
      continue;
    }
    EXPECT_NE(md.find(row), std::string::npos) << "no table row starts with " << row;
  }
  EXPECT_GT(test_only, 0);
}

TEST(BackendsDocTest, SmRangeAndConflictsAreShown) {
  std::vector<BackendDescriptor> registry;
  registry.push_back(
      {"device", "cuda", Device::kCuda, 80, 0, true, {}, {}, PrecisionClass::kFp32, "gpu"});
  BackendDescriptor hopper;
  hopper.axis = "x";
  hopper.value = "hopper";
  hopper.device = Device::kCuda;
  hopper.min_sm = hopper.max_sm = 90;
  hopper.weight_formats = {"bf16"};
  hopper.conflicts = {"y=a: because", "y=b"};
  hopper.quantized_conflicts = {"q=r"};
  hopper.precision = PrecisionClass::kBf16;
  hopper.description = "a | b";
  registry.push_back(hopper);
  const std::string md = cli::BackendsMarkdown(registry);
  EXPECT_NE(md.find("| x | hopper | cuda | = 90 | bf16 | `y=a`, `y=b`, `q=r` (quantized) | bf16 "
                    "| a \\| b |"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("| device | cuda | cuda | ≥ 80 |"), std::string::npos) << md;
  EXPECT_NE(md.find("do not edit by hand"), std::string::npos);
}

}  // namespace
}  // namespace infersweep
