// MoE routing: softmax over router logits in fp32, top-k, optional renormalisation.
#pragma once

#include <cstdint>

namespace infersweep::cpu {

// logits: [num_experts]. Writes the k chosen experts (highest probability first; ties go to the
// lower index, as torch.topk does on CPU) and their weights.
void TopKRouting(const float* logits, int num_experts, int k, bool renormalize, int* experts,
                 float* weights);

}  // namespace infersweep::cpu
