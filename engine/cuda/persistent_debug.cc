#include "engine/cuda/persistent_debug.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/cuda/device_util.h"

namespace infersweep {

void ApplyPersistentFaults(const FaultInjection& fault, int l, cuda::PersistentLayer& p) {
  if (fault.kind == FaultInjection::Kind::kBadScale && l == 0)
    p.o_scale = static_cast<float>(fault.value);
  if (fault.kind == FaultInjection::Kind::kZeroExpert)
    p.skip_expert = static_cast<int>(fault.value);
  p.nan_after = fault.kind == FaultInjection::Kind::kNanLayer && l == static_cast<int>(fault.value);
}

const char* PersistentTimelinePath() { return std::getenv("INFERSWEEP_PERSISTENT_TIMELINE"); }

size_t PersistentTimelineBytes(int layers) {
  return static_cast<size_t>(cuda::PersistentDecodeBlocks()) *
         cuda::PersistentTimelineEvents(layers) * 8;
}

void ReportPersistentTimeline(const cuda::PersistentDecodeArgs& args, int layers,
                              const std::string& path) {
  const int blocks = cuda::PersistentDecodeBlocks();
  std::vector<unsigned long long> stamps(static_cast<size_t>(blocks) *
                                         cuda::PersistentTimelineEvents(layers));
  CUDA_OR_DIE(cudaMemcpy(stamps.data(), args.timeline, stamps.size() * 8, cudaMemcpyDeviceToHost));
  WritePersistentTimeline(path, stamps, blocks, layers,
                          cuda::PersistentDecodeRingBytes(args.shape));
  // Zeroed for the next step: a stamp left unwritten (a block that is not the combining split
  // this time) must not keep an older step's time.
  CUDA_OR_DIE(cudaMemset(args.timeline, 0, stamps.size() * 8));
  CUDA_OR_DIE(cudaDeviceSynchronize());  // the legacy stream's memset, before the next step
}

// One persistent decode step's stamps (cuda::PersistentDecodeArgs::timeline) as a table of
// where a layer's time goes, per phase, averaged over the layers that have it: the phase's time
// (departure from its barrier minus departure from the previous one, mean over blocks), the blocks'
// mean and slowest work before arriving at the barrier, and what the barrier added after the
// slowest block arrived.
void WritePersistentTimeline(const std::string& path, const std::vector<unsigned long long>& t,
                             int blocks, int layers, int ring_bytes) {
  const int events = cuda::PersistentTimelineEvents(layers);
  constexpr int kPhases = cuda::kPersistentPhases;
  static const char* kNames[kPhases] = {"q/k/v", "attention", "o", "router", "gate/up", "down"};
  double time[kPhases] = {}, work_mean[kPhases] = {}, work_max[kPhases] = {}, count[kPhases] = {};
  auto at = [&](int b, int e) {
    return static_cast<double>(t[static_cast<size_t>(b) * events + e]);
  };
  int previous = 0;  // event of the previous departure (the kernel's start first)
  for (int l = 0; l < layers; ++l)
    for (int p = 0; p < kPhases; ++p) {
      const int arrive = 1 + (l * kPhases + p) * 2;
      if (at(0, arrive) == 0) continue;  // the router (no phase of its own)
      const bool last = l == layers - 1 && p == kPhases - 1;
      double sum_time = 0, sum_work = 0, max_work = 0;
      for (int b = 0; b < blocks; ++b) {
        const double work = at(b, arrive) - at(b, previous);
        sum_work += work;
        max_work = std::max(max_work, work);
        sum_time += (last ? at(b, arrive) : at(b, arrive + 1)) - at(b, previous);
      }
      time[p] += sum_time / blocks;
      work_mean[p] += sum_work / blocks;
      work_max[p] += max_work;
      count[p] += 1;
      previous = arrive + 1;
    }
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return;
  std::fprintf(f,
               "# persistent decode step, %d layers, %d blocks, %d-byte warp rings: us a layer, "
               "mean over layers\n",
               layers, blocks, ring_bytes);
  std::fprintf(f, "%-10s %8s %10s %10s %10s\n", "phase", "time", "work_mean", "work_max",
               "barrier");
  double total = 0;
  for (int p = 0; p < kPhases; ++p) {
    if (count[p] == 0) continue;
    const double n = count[p] * 1e3;  // ns -> us
    total += time[p] / n * count[p] / layers;
    std::fprintf(f, "%-10s %8.2f %10.2f %10.2f %10.2f\n", kNames[p], time[p] / n, work_mean[p] / n,
                 work_max[p] / n, (time[p] - work_max[p]) / n);
  }
  std::fprintf(f, "%-10s %8.2f\n", "layer", total);
  // Inside attention, from the block's departure from the q/k/v barrier: mean over the splits
  // (and the combining splits) and layers.
  double step[4] = {}, steps[4] = {};
  for (int l = 0; l < layers; ++l)
    for (int b = 0; b < blocks; ++b) {
      const int s0 = cuda::PersistentAttentionStamp(layers, l);
      // Departure from the barrier ending the q/k/v phase (phase 0 of the layer).
      double previous_stamp = at(b, 2 + l * kPhases * 2);
      for (int k = 0; k < cuda::kPersistentAttentionStamps; ++k) {
        if (at(b, s0 + k) == 0) break;  // no split in this block, or not the combining one
        step[k] += at(b, s0 + k) - previous_stamp;
        steps[k] += 1;
        previous_stamp = at(b, s0 + k);
      }
    }
  // Inside q/k/v, o and the MLP (PersistentStep), from the block's departure from the previous
  // barrier to its arrival at the phase's own: mean over blocks and layers.
  struct StepRow {
    const char* name;
    std::vector<std::pair<const char*, int>> steps;  // (name, PersistentStep; -1 the barrier)
    double sum[4] = {};
    double n[4] = {};
  };
  StepRow rows[] = {
      {"q/k/v", {{"staged", cuda::kQkvStaged}, {"rows", cuda::kQkvRows}, {"to barrier", -1}}},
      {"o", {{"staged", cuda::kOStaged}, {"rows", cuda::kORows}, {"to barrier", -1}}},
      {"MLP",
       {{"routed", cuda::kMlpRouted},
        {"first pair", cuda::kMlpFirstPair},
        {"pairs", cuda::kMlpPairs},
        {"to barrier", -1}}},
  };
  // The phases' indices (kNames): the MLP ends at gate/up's barrier in the quantized builds,
  // at down's in the bf16 one (gate/up's slots stay 0 there).
  constexpr int kQkv = 0, kAttention = 1, kO = 2, kGateUp = 4, kDown = 5;
  auto departure = [&](int l, int p) { return 2 + (l * kPhases + p) * 2; };
  // The MLP's steps per block too: whether a slow block starts late or streams slowly.
  std::vector<std::array<double, 4>> mlp_sum(blocks), mlp_n(blocks);
  for (int l = 0; l < layers; ++l)
    for (int b = 0; b < blocks; ++b)
      for (int r = 0; r < 3; ++r) {
        const int from = r == 0   ? (l == 0 ? 0 : departure(l - 1, kDown))
                         : r == 1 ? departure(l, kAttention)
                                  : departure(l, kO);
        const int phase_end = r == 0   ? kQkv
                              : r == 1 ? kO
                                       : (at(b, departure(l, kGateUp) - 1) ? kGateUp : kDown);
        double previous_stamp = at(b, from);
        for (size_t k = 0; k < rows[r].steps.size(); ++k) {
          const int step = rows[r].steps[k].second;
          const double now = step < 0 ? at(b, departure(l, phase_end) - 1)
                                      : at(b, cuda::PersistentStepStamp(layers, l) + step);
          if (now == 0 || previous_stamp == 0) break;
          rows[r].sum[k] += now - previous_stamp;
          rows[r].n[k] += 1;
          if (r == 2) mlp_sum[b][k] += now - previous_stamp, mlp_n[b][k] += 1;
          previous_stamp = now;
        }
      }
  // Per block (and the SM it ran on), the mean work of each phase that has a barrier: which
  // blocks hold the barriers up (on the H200 the slowest block differs from layer to layer).
  std::vector<std::string> per_block;
  for (int b = 0; b < blocks; ++b) {
    double work[kPhases] = {}, n[kPhases] = {};
    int from = 0;
    for (int l = 0; l < layers; ++l)
      for (int p = 0; p < kPhases; ++p) {
        const int arrive = 1 + (l * kPhases + p) * 2;
        if (at(b, arrive) == 0) continue;
        work[p] += at(b, arrive) - at(b, from);
        n[p] += 1;
        from = arrive + 1;
      }
    std::string line =
        absl::StrFormat("# block %3d sm %3llu:", b, t[static_cast<size_t>(b + 1) * events - 1]);
    for (int p = 0; p < kPhases; ++p)
      if (n[p]) absl::StrAppendFormat(&line, " %s %.2f", kNames[p], work[p] / n[p] / 1e3);
    absl::StrAppend(&line, " | MLP steps");
    for (int k = 0; k < 4; ++k)
      absl::StrAppendFormat(&line, " %.2f", mlp_n[b][k] ? mlp_sum[b][k] / mlp_n[b][k] / 1e3 : 0.0);
    per_block.push_back(line);
  }
  static const char* kSteps[] = {"loads+norm", "keys", "publish", "combine"};
  std::fprintf(f, "# attention steps (us, mean over splits):");
  for (int k = 0; k < cuda::kPersistentAttentionStamps; ++k)
    std::fprintf(f, " %s %.2f", kSteps[k], steps[k] ? step[k] / steps[k] / 1e3 : 0.0);
  std::fprintf(f, "\n");
  for (const StepRow& row : rows) {
    std::fprintf(f, "# %s steps (us, mean over blocks):", row.name);
    for (size_t k = 0; k < row.steps.size(); ++k)
      std::fprintf(f, " %s %.2f", row.steps[k].first, row.n[k] ? row.sum[k] / row.n[k] / 1e3 : 0.0);
    std::fprintf(f, "\n");
  }
  // The blocks whose first expert pair comes last, with their SMs (on the H200 the same ones in
  // every layer of a launch, and on one machine the same SMs from launch to launch: whole TPCs,
  // e.g. SMs 12-13, 28-29, ..., 120-121): their share of the MLP's slowest block.
  std::vector<std::pair<double, int>> first_pair;
  for (int b = 0; b < blocks; ++b)
    if (mlp_n[b][1]) first_pair.push_back({mlp_sum[b][1] / mlp_n[b][1] / 1e3, b});
  if (!first_pair.empty()) {
    std::sort(first_pair.begin(), first_pair.end());
    const size_t late = std::max<size_t>(1, first_pair.size() / 8);
    double late_mean = 0;
    std::string late_blocks;
    for (size_t i = first_pair.size() - late; i < first_pair.size(); ++i) {
      late_mean += first_pair[i].first / late;
      const int b = first_pair[i].second;
      absl::StrAppendFormat(&late_blocks, "%s%d/sm%llu", late_blocks.empty() ? "" : " ", b,
                            t[static_cast<size_t>(b + 1) * events - 1]);
    }
    std::fprintf(f,
                 "# MLP first pair (us, per block): median %.2f; the latest eighth %.2f "
                 "(block/SM %s)\n",
                 first_pair[first_pair.size() / 2].first, late_mean, late_blocks.c_str());
  }
  for (const std::string& line : per_block) std::fprintf(f, "%s\n", line.c_str());
  std::fclose(f);
}

}  // namespace infersweep
