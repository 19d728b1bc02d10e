// Token selection from logits: greedy, or seeded sampling that any device reproduces exactly.
#pragma once

#include <cstdint>
#include <span>

namespace infersweep {

struct SamplingParams {
  float temperature = 0.f;  // 0: greedy
  int top_k = 0;            // 0: whole vocabulary
  uint64_t seed = 0;
};

// Argmax; the lowest index wins ties. NaN logits never win (an all-NaN row returns 0).
int32_t Greedy(std::span<const float> logits);

// Samples with a counter-based draw keyed by (seed, sequence, step): the same inputs give the
// same token on every run and every device.
int32_t SampleToken(std::span<const float> logits, const SamplingParams& params, int sequence,
                    int step);

}  // namespace infersweep
