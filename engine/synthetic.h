// Synthetic weights of a model's tensors: the per-tensor scale and offset by weight kind, and the
// host generator (the formula itself is core/synthetic.h's, which the CUDA generator shares).
#pragma once

#include <cstdint>
#include <string_view>

#include "core/synthetic.h"
#include "engine/tensor_spec.h"

namespace infersweep {

// Linear weights get variance 1/fan_in (activations keep their scale through every layer),
// norm gains 1 +- 0.1 (zero-centred ones +-0.1), biases +-0.1, embeddings +-0.05; the conv like a
// linear of fan_in kernel; dt_bias -3 +- 1 and A_log 0.5 +- 1, so decays stay in a trained range.
SyntheticInit SyntheticInitFor(const TensorSpec& spec);

// The canonical name whose values a tensor takes (a tied lm_head repeats the embeddings).
std::string_view SyntheticSourceName(const TensorSpec& spec, bool tie_word_embeddings);

// Fills out[0, n) with bf16 elements [first, first + n) of the tensor.
void GenerateSyntheticBf16(uint64_t seed, const TensorSpec& spec, bool tie_word_embeddings,
                           int64_t first, int64_t n, uint16_t* out);

}  // namespace infersweep
