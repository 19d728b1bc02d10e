#include "engine/tensor_spec.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/quant/layout.h"

namespace infersweep {
namespace {

void AddLinear(std::vector<TensorSpec>& specs, std::string name, int64_t out, int64_t in,
               int layer, int expert = -1) {
  specs.push_back({std::move(name), {out, in}, WeightKind::kLinear, layer, expert, in});
}

void AddVector(std::vector<TensorSpec>& specs, std::string name, int64_t n, WeightKind kind,
               int layer) {
  specs.push_back({std::move(name), {n}, kind, layer, -1, 0});
}

// Gated DeltaNet in the flat layout (Qwen3.5's names); the checkpoint loader un-groups
// Qwen3-Next's in_proj_qkvz / in_proj_ba into it.
void AddLinearAttention(std::vector<TensorSpec>& specs, const ModelConfig& c, const std::string& p,
                        int l) {
  const int64_t hidden = c.hidden_size, value_heads = c.linear_num_value_heads;
  const int64_t conv_dim = c.linear_conv_dim(), kernel = c.linear_conv_kernel_dim;
  const std::string la = p + "linear_attn.";
  AddLinear(specs, la + "in_proj_qkv.weight", conv_dim, hidden, l);
  AddLinear(specs, la + "in_proj_z.weight", c.linear_value_dim(), hidden, l);
  AddLinear(specs, la + "in_proj_b.weight", value_heads, hidden, l);
  AddLinear(specs, la + "in_proj_a.weight", value_heads, hidden, l);
  specs.push_back({la + "conv1d.weight", {conv_dim, 1, kernel}, WeightKind::kConv, l, -1, kernel});
  AddVector(specs, la + "dt_bias", value_heads, WeightKind::kDtBias, l);
  AddVector(specs, la + "A_log", value_heads, WeightKind::kALog, l);
  AddVector(specs, la + "norm.weight", c.linear_value_head_dim, WeightKind::kNorm, l);
  AddLinear(specs, la + "out_proj.weight", hidden, c.linear_value_dim(), l);
}

}  // namespace

std::vector<TensorSpec> ModelTensorSpecs(const ModelConfig& c) {
  std::vector<TensorSpec> specs;
  const int64_t hidden = c.hidden_size;
  // Hybrid decoder norms scale by (1 + w): their synthetic values centre on 0, not 1.
  const WeightKind norm = c.zero_centered_norm ? WeightKind::kCenteredNorm : WeightKind::kNorm;
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, hidden}, WeightKind::kEmbedding,
                   -1, -1, hidden});
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    AddVector(specs, p + "input_layernorm.weight", hidden, norm, l);
    if (c.AttentionKind(l) == LayerAttention::kLinear) {
      AddLinearAttention(specs, c, p, l);
    } else {
      // A gated q_proj holds [q_h | gate_h] per head.
      AddLinear(specs, p + "self_attn.q_proj.weight", c.q_dim() * (c.attn_output_gate ? 2 : 1),
                hidden, l);
      AddLinear(specs, p + "self_attn.k_proj.weight", c.kv_dim(), hidden, l);
      AddLinear(specs, p + "self_attn.v_proj.weight", c.kv_dim(), hidden, l);
      if (c.attention_bias) {
        AddVector(specs, p + "self_attn.q_proj.bias", c.q_dim(), WeightKind::kBias, l);
        AddVector(specs, p + "self_attn.k_proj.bias", c.kv_dim(), WeightKind::kBias, l);
        AddVector(specs, p + "self_attn.v_proj.bias", c.kv_dim(), WeightKind::kBias, l);
      }
      if (c.qk_norm) {
        AddVector(specs, p + "self_attn.q_norm.weight", c.head_dim, norm, l);
        AddVector(specs, p + "self_attn.k_norm.weight", c.head_dim, norm, l);
      }
      AddLinear(specs, p + "self_attn.o_proj.weight", hidden, c.q_dim(), l);
      if (c.attention_bias && c.arch != ModelArch::kQwen2Moe)  // Qwen2's o_proj has no bias
        AddVector(specs, p + "self_attn.o_proj.bias", hidden, WeightKind::kBias, l);
    }
    AddVector(specs, p + "post_attention_layernorm.weight", hidden, norm, l);
    if (c.IsMoeLayer(l)) {
      specs.push_back({p + "mlp.gate.weight", {c.num_experts, hidden}, WeightKind::kRouter, l, -1,
                       hidden});
      for (int e = 0; e < c.num_experts; ++e) {
        const std::string ep = absl::StrCat(p, "mlp.experts.", e, ".");
        AddLinear(specs, ep + "gate_proj.weight", c.moe_intermediate_size, hidden, l, e);
        AddLinear(specs, ep + "up_proj.weight", c.moe_intermediate_size, hidden, l, e);
        AddLinear(specs, ep + "down_proj.weight", hidden, c.moe_intermediate_size, l, e);
      }
      if (c.shared_expert_intermediate_size > 0) {
        const int64_t si = c.shared_expert_intermediate_size;
        AddLinear(specs, p + "mlp.shared_expert.gate_proj.weight", si, hidden, l);
        AddLinear(specs, p + "mlp.shared_expert.up_proj.weight", si, hidden, l);
        AddLinear(specs, p + "mlp.shared_expert.down_proj.weight", hidden, si, l);
        AddLinear(specs, p + "mlp.shared_expert_gate.weight", 1, hidden, l);
      }
    } else {
      AddLinear(specs, p + "mlp.gate_proj.weight", c.intermediate_size, hidden, l);
      AddLinear(specs, p + "mlp.up_proj.weight", c.intermediate_size, hidden, l);
      AddLinear(specs, p + "mlp.down_proj.weight", hidden, c.intermediate_size, l);
    }
  }
  AddVector(specs, "model.norm.weight", hidden, norm, -1);
  AddLinear(specs, "lm_head.weight", c.vocab_size, hidden, -1);
  return specs;
}

bool IsQuantizable(const TensorSpec& spec) {
  // ModelOpt's default exclusions: the head, the one-row gates and the per-head decay and beta
  // projections of Gated DeltaNet (the router and conv1d are not linears here).
  return spec.kind == WeightKind::kLinear && spec.name != "lm_head.weight" &&
         !absl::EndsWith(spec.name, "mlp.shared_expert_gate.weight") &&
         !absl::EndsWith(spec.name, ".linear_attn.in_proj_a.weight") &&
         !absl::EndsWith(spec.name, ".linear_attn.in_proj_b.weight");
}

absl::StatusOr<std::vector<TensorSpec>> QuantizedTensorSpecs(
    const std::vector<TensorSpec>& dense,
    const std::function<QuantFormat(const TensorSpec&)>& format_of) {
  std::vector<TensorSpec> out;
  out.reserve(dense.size());
  for (const TensorSpec& spec : dense) {
    // format_of sees every spec (a checkpoint reports its contradictions from it); only linears
    // take a format.
    const QuantFormat format = format_of(spec);
    if (spec.kind != WeightKind::kLinear || format == QuantFormat::kNone) {
      out.push_back(spec);
      continue;
    }
    auto layout = QuantLayout(format, spec.shape[0], spec.shape[1]);
    if (!layout.ok())
      return absl::Status(layout.status().code(),
                          absl::StrCat(spec.name, ": ", layout.status().message()));
    // Canonical names end in ".weight"; each part swaps that suffix for its own.
    const std::string module = spec.name.substr(0, spec.name.size() - 7);
    for (const QuantPartLayout& part : *layout) {
      TensorSpec p = spec;
      p.name = module + part.suffix;
      p.shape = part.shape;
      p.quant = format;
      p.part = part.part;
      p.linear = spec.name;
      p.dtypes = part.dtypes;
      p.optional = part.optional;
      p.rule = part.rule;
      out.push_back(std::move(p));
    }
  }
  return out;
}

}  // namespace infersweep
