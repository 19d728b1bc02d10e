// cuDNN, loaded at run time with dlopen: binaries never link it, so they start on machines
// without it, and only the backends that need it are refused there (UNSUPPORTED, naming the
// library and the version found).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace infersweep {

struct CudnnLibrary {
  void* handle = nullptr;  // dlopen's
  std::string path;        // the file loaded
  size_t version = 0;      // cudnnGetVersion(): major * 10000 + minor * 100 + patch (cuDNN 9)
};

// cuDNN 9's version number as text: 91002 -> "9.10.2".
std::string CudnnVersionText(size_t version);

// Where libcudnn.so.9 is looked for, in order: each folder of `ld_library_path`, then
// `extra_dirs` (INFERSWEEP_CUDNN_DIR, the bundle's record of PyTorch's wheel), then PyTorch's
// wheel under /usr/local/lib/python3*/{dist,site}-packages/nvidia/cudnn/lib and
// /usr/lib/python3/dist-packages/nvidia/cudnn/lib. Files, not yet checked to exist.
std::vector<std::string> CudnnCandidates(std::string_view ld_library_path,
                                         const std::vector<std::string>& extra_dirs);

// Loads the first candidate that dlopen takes and reads its version (cudnnGetVersion). NotFound
// naming the folders looked in, or the library's own dlopen error, when none loads.
absl::StatusOr<CudnnLibrary> LoadCudnnFrom(const std::vector<std::string>& candidates);

// The process's cuDNN, loaded once (from LD_LIBRARY_PATH, INFERSWEEP_CUDNN_DIR and PyTorch's
// wheel); the error of that one attempt when none loaded.
absl::StatusOr<const CudnnLibrary*> ProcessCudnn();

// OK when `library` is cuDNN `min_version` or newer; else Unimplemented: "<who> needs cuDNN
// >= 9.x.y; found 9.a.b (<path>)", or, without a library, "<who> needs cuDNN >= 9.x.y: <why>".
absl::Status RequireCudnn(const absl::StatusOr<const CudnnLibrary*>& library, size_t min_version,
                          std::string_view who);

}  // namespace infersweep
