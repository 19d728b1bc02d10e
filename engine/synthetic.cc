#include "engine/synthetic.h"

#include <cmath>

namespace infersweep {

SyntheticInit SyntheticInitFor(const TensorSpec& spec) {
  switch (spec.kind) {
    case WeightKind::kNorm:
      return {0.1f, 1.0f};
    case WeightKind::kCenteredNorm:
      return {0.1f, 0.f};
    case WeightKind::kDtBias:
      // softplus(a + dt_bias) of a few hundredths to a tenth, as trained models have
      return {1.0f, -3.0f};
    case WeightKind::kALog:
      // A = exp(A_log) in about [0.6, 4.5]
      return {1.0f, 0.5f};
    case WeightKind::kBias:
      return {0.1f, 0.f};
    case WeightKind::kEmbedding:
      return {0.05f, 0.f};
    case WeightKind::kLinear:
    case WeightKind::kRouter:
    case WeightKind::kConv:
      // uniform(-a, a) has variance a^2 / 3, so a = sqrt(3 / fan_in) gives 1 / fan_in.
      return {static_cast<float>(std::sqrt(3.0 / static_cast<double>(spec.fan_in))), 0.f};
  }
  return {};
}

std::string_view SyntheticSourceName(const TensorSpec& spec, bool tie_word_embeddings) {
  if (tie_word_embeddings && spec.name == "lm_head.weight") return "model.embed_tokens.weight";
  return spec.name;
}

void GenerateSyntheticBf16(uint64_t seed, const TensorSpec& spec, bool tie_word_embeddings,
                           int64_t first, int64_t n, uint16_t* out) {
  const bool tied = tie_word_embeddings && spec.name == "lm_head.weight";
  TensorSpec source_spec = spec;
  if (tied) source_spec.kind = WeightKind::kEmbedding;
  const SyntheticInit init = SyntheticInitFor(source_spec);
  const uint64_t stream =
      SyntheticStream(seed, HashTensorName(SyntheticSourceName(spec, tie_word_embeddings)));
  for (int64_t i = 0; i < n; ++i) {
    const float u = SyntheticUniform(stream, static_cast<uint64_t>(first + i));
    const volatile float scaled = init.scale * u;  // volatile: keep mul and add separately rounded
    out[i] = FloatToBf16(scaled + init.offset);
  }
}

}  // namespace infersweep
