// CudaModelRefusal: every op family's model limits (engine/plan/model_limits.h), and
// graphs=persistent's, which its kernel states in the CUDA build.
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "engine/cuda/cuda_model.h"
#include "engine/cuda/persistent_decode.h"
#include "engine/plan/model_limits.h"

namespace infersweep {

std::string CudaModelRefusal(const ModelConfig& c, QuantFormat weights,
                             const CudaOptions& options) {
  std::vector<std::string> why = CudaModelLimitRefusals(c, options);
  if (IsPersistent(options.graphs))
    if (std::string persistent =
            PersistentDecodeRefusal(c, PersistentStreamFormat(weights, options.qgemm));
        !persistent.empty())
      why.push_back(std::move(persistent));
  return absl::StrJoin(why, "; ");
}

}  // namespace infersweep
