// What the CUDA backends need of a model, from each op family's plan: the attention plan's heads,
// the MoE plan's shapes, linear attention's key heads and conv, the collective's hidden size.
// Every reason that applies is returned, not only the first. Config-only conflicts are the
// registry's (api/backend_config.h); graphs=persistent's kernel limits are asked of its kernel
// in the CUDA build (engine/cuda/model_refusal.cc). Host code: built and tested without CUDA.
#pragma once

#include <string>
#include <vector>

#include "api/model_config.h"
#include "engine/options.h"

namespace infersweep {

std::vector<std::string> CudaModelLimitRefusals(const ModelConfig& model,
                                                const CudaOptions& options);

}  // namespace infersweep
