// The MoE block of a CUDA model's step: the router (fp32 on every config), top-k routing, and
// the experts by the moe axis: the per-expert loop with a host sync (loop), cuBLAS grouped GEMMs
// (grouped, and long bf16 prefill chunks of fused), per-pair GEMVs and expert-grouped MMAs on
// device-side routing (fused, wgmma), quantized experts in registers (w4a16, w8a16); then the
// shared expert. Owns the routing and expert scratch and the router's fp32 copies. A rank at ep=on
// holds a run of whole experts (engine/weights.h's HeldExpertRange): the routing stays over every
// expert, and each path leaves out the pairs routed to experts it does not hold (the host routing
// for loop and grouped, the kernels' expert range for fused and wgmma), so the all-reduce of the
// ranks' partial sums adds each pair once.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/device_util.h"
#include "engine/cuda/linear_runner.h"
#include "engine/cuda/runner_context.h"
#include "engine/cuda/weight_upload.h"
#include "engine/plan/moe_plan.h"
#include "engine/weights.h"
#include "kernels/cuda/moe_grouped.h"

namespace infersweep {

class MoeRunner {
 public:
  // `dw`: the shared upload (its bf16 expert tables); `view`: a quantized model's view (its own
  // tables), else null; `grouped`: cuBLAS grouped GEMMs (moe=grouped, and moe=fused on cuBLASLt
  // configs for long prefill chunks), else null.
  MoeRunner(const RunnerContext& context, LinearRunner& linear, const DeviceWeights* dw,
            const QuantView* view, std::unique_ptr<cuda::CublasGroupedGemm> grouped);
  MoeRunner(const MoeRunner&) = delete;
  MoeRunner& operator=(const MoeRunner&) = delete;

  // Scratch for `rows` rows (freed first by FreeScratch). Dense models have it too: the
  // persistent kernel's router logits live in router().
  absl::Status AllocateScratch(int rows);
  void FreeScratch();
  // fp32 copies of the MoE routers for cuBLASLt's fp32 GEMM, made once, outside any capture.
  absl::Status MakeRouterCopies();

  // Layer l's MoE block over `rows` rows (`n` tokens a sequence) of the residual stream x, its
  // output added into `out` (x itself, or a partial that the collective seam reduces first).
  // `gemv`: the fused GEMV path (gemm=fused|tma, decode rows).
  absl::Status Run(int l, int rows, int n, bool gemv, float* x, float* out);

  // [rows, experts] router logits, + 1 float (graphs=persistent's sum of squares of x).
  float* router() const { return router_.get(); }

 private:
  // The routing of `rows` rows read back to the host: pairs (row, slot) grouped by expert, with
  // the row index and routing weight of each uploaded to route_index_ / route_weight_, and the
  // position of every pair in that order uploaded to pair_position_ (-1: left out).
  struct HostRouting {
    std::vector<int> index;
    std::vector<float> index_weight;
    std::vector<int> pair_position;
    std::vector<std::pair<int, int>> spans;  // per expert: first pair, count
  };
  // The layer's experts as the plan sees them.
  MoeLayerFacts LayerFacts(int l) const;
  // Whether expert e's pairs run here (held, and not the TEST ONLY zero-expert fault's `skip`).
  static bool RunsExpert(const HeldExperts& held, int skip, int e) {
    return held.holds(e) && e != skip;
  }
  // router = xn . Wr^T in fp32 by `path` (not kFusedGemv, which Run launches with the norm).
  absl::Status Router(int l, int rows, MoeRouter path);
  HostRouting RouteOnHost(int rows, int skip, const HeldExperts& held);
  absl::Status GroupedExperts(const LayerWeights& lw, int rows, const HostRouting& routing,
                              float* x);
  bool ExpertsQuantizedAlike(int l) const;
  absl::StatusOr<std::array<const uint16_t* const*, 3>> PrefillExpertCopies(int l);

  const ModelConfig& config_;
  const ModelWeights& w_;
  const CudaOptions& options_;
  const FaultInjection& fault_;
  cudaStream_t stream_;
  LinearRunner& linear_;
  const DeviceWeights* dw_;
  const QuantView* view_;
  std::unique_ptr<cuda::CublasGroupedGemm> grouped_;
  // Per layer: the experts this model holds ([0, 0) for dense layers); an error where a layer's
  // experts are not one run of whole experts (Run returns it).
  std::vector<HeldExperts> held_;
  absl::Status held_status_;
  std::vector<DeviceBuffer<float>> router_f32_;  // per layer (MakeRouterCopies); none: dense layer
  DeviceBuffer<float> router_, expert_weights_, moe_h_, moe_out_, moe_in_, route_weight_;
  DeviceBuffer<int> expert_ids_, route_index_, pair_position_, expert_offsets_;
  DeviceBuffer<uint16_t> xn_bf16_;          // the block's normalised input in bf16
  DeviceBuffer<uint16_t> moe_bf16_;         // moe=grouped: gate | up | pair outputs, bf16
  DeviceBuffer<uint8_t> fp8_codes_;         // qgemm=w8a8: x [rows, hidden] | h [pairs, inter]
  DeviceBuffer<float> fp8_scales_;          // qgemm=w8a8: x's [rows] | h's [pairs]
  DeviceBuffer<unsigned> topk_counter_;     // the fused router's block count (cuda::GemvTopK)
  DeviceBuffer<uint16_t> prefill_experts_;  // PrefillExpertCopies: [gate | up | down][expert]
  DeviceBuffer<const uint16_t*> prefill_expert_tables_;
  HeldExperts prefill_tables_held_;  // the experts prefill_expert_tables_ point at
  std::vector<DeviceBuffer<MatrixRef>> prefill_expert_refs_;  // per layer: its experts' refs
};

}  // namespace infersweep
