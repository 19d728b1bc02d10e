// cuDNN's run-time loader (engine/cudnn_loader.h): where it looks, and what a missing or older
// library makes of the backends that need it.
#include "engine/cudnn_loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace infersweep {
namespace {

using testing::HasSubstr;

TEST(CudnnLoader, LooksInLdLibraryPathThenTheGivenFolders) {
  const std::vector<std::string> c = CudnnCandidates("/a::/b/lib", {"/wheel/nvidia/cudnn/lib", ""});
  ASSERT_GE(c.size(), 3u);
  EXPECT_EQ(c[0], "/a/libcudnn.so.9");
  EXPECT_EQ(c[1], "/b/lib/libcudnn.so.9");
  EXPECT_EQ(c[2], "/wheel/nvidia/cudnn/lib/libcudnn.so.9");
}

TEST(CudnnLoader, VersionText) {
  EXPECT_EQ(CudnnVersionText(91002), "9.10.2");
  EXPECT_EQ(CudnnVersionText(90000), "9.0.0");
}

// No library: backends needing it are UNSUPPORTED (Unimplemented), naming the library and where
// it was looked for.
TEST(CudnnLoader, MissingLibraryRefusesNamingIt) {
  absl::StatusOr<CudnnLibrary> none = LoadCudnnFrom({"/nonexistent/libcudnn.so.9"});
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(absl::IsNotFound(none.status()));
  EXPECT_THAT(none.status().message(), HasSubstr("/nonexistent/libcudnn.so.9"));
  const absl::StatusOr<const CudnnLibrary*> library = none.status();
  absl::Status s = RequireCudnn(library, 91000, "attention=cudnn");
  EXPECT_TRUE(absl::IsUnimplemented(s)) << s;
  EXPECT_THAT(s.message(),
              HasSubstr("attention=cudnn needs cuDNN >= 9.10.0: libcudnn.so.9 not found"));
}

// An older library loads, reports its version, and refuses what needs a newer one, naming the
// version found and its file; what it is new enough for passes.
TEST(CudnnLoader, OlderLibraryRefusesNamingTheVersionFound) {
  absl::StatusOr<CudnnLibrary> lib =
      LoadCudnnFrom(CudnnCandidates(absl::StrCat("/nonexistent:", FAKE_CUDNN_DIR), {}));
  ASSERT_TRUE(lib.ok()) << lib.status();
  EXPECT_EQ(lib->version, 90000u);
  EXPECT_THAT(lib->path, HasSubstr("fake_cudnn/libcudnn.so.9"));
  const absl::StatusOr<const CudnnLibrary*> library = &*lib;
  absl::Status s = RequireCudnn(library, 90500, "attention=cudnn");
  EXPECT_TRUE(absl::IsUnimplemented(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("attention=cudnn needs cuDNN >= 9.5.0; found 9.0.0 ("));
  EXPECT_TRUE(RequireCudnn(library, 90000, "attention=cudnn").ok());
}

}  // namespace
}  // namespace infersweep
