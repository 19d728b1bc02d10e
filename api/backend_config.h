// Backend configurations: a map axis -> value (e.g. device=cuda,attention=flash,graphs=on), the
// registry of every backend value with what it needs, and the preflight that judges a config
// UNSUPPORTED before any weights load.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "api/model_config.h"

namespace infersweep {

// Sorted by axis, so the canonical string is stable: "device=cpu,matmul=blocked,threads=2".
using BackendConfig = std::map<std::string, std::string>;

std::string BackendConfigString(const BackendConfig& config);
// Parses "axis=value,axis=value". Errors name the offending item; duplicate axes are errors.
absl::StatusOr<BackendConfig> ParseBackendConfig(std::string_view text);

// The device a backend runs on: the device axis's values, in the registry's order. Configs,
// selectors and stored rows spell it as text; it is parsed once where it comes in (ParseDevice,
// NormalizeBackendConfig) and compared as this enum everywhere else.
enum class Device { kCpu, kCuda };
// The registry's spelling of a device ("cpu", "cuda"); a C string, as AxisValueName's.
const char* DeviceName(Device device);
// `name` as a Device; InvalidArgument "<field>: unknown value '<name>' (known: cpu, cuda)" for a
// name the registry's device axis does not hold.
absl::StatusOr<Device> ParseDevice(std::string_view name, std::string_view field);

// How close to the fp32 reference a backend is meant to be; sets the verdict thresholds.
enum class PrecisionClass { kFp32, kBf16, kFp8, kFp4 };
std::string_view PrecisionClassName(PrecisionClass p);

// One value of one axis, and what it needs to run.
struct BackendDescriptor {
  std::string axis;
  std::string value;
  Device device = Device::kCpu;  // the device the value runs on
  // Inclusive SM range for cuda backends, e.g. {90, 90} for sm_90a-only code; 0 = unbounded.
  int min_sm = 0;
  int max_sm = 0;
  bool needs_cuda_build = false;
  std::vector<std::string> weight_formats;  // empty = any; else e.g. {"bf16","f16","f32"}
  // "axis=value" entries it cannot be combined with, each optionally followed by ": " and why
  // (the reason preflight gives).
  std::vector<std::string> conflicts;
  PrecisionClass precision = PrecisionClass::kFp32;
  std::string description;
  // "axis=value" entries it cannot be combined with on quantized weights (fp8, nvfp4, mxfp4)
  // only, each optionally followed by ": " and why, e.g. moe=fused with qgemm=reference, which
  // has no fused expert runner.
  std::vector<std::string> quantized_conflicts = {};
  // TEST ONLY rows: selectable by name, left out of the generated docs and of the backends an
  // agent advertises, so no sweep lists them unless a test names them.
  bool test_only = false;
};

// Every registered backend value, for every axis and device: the one table.
const std::vector<BackendDescriptor>& BackendRegistry();
// The values of `axis` on `device`, in the table's order (test-only rows included): the order
// of the engine's enum for that axis (engine/options.h), whose names these are.
std::vector<std::string> RegisteredValues(Device device, std::string_view axis);

// Axes of a device and their default values (what an absent axis means).
std::map<std::string, std::string> DefaultAxes(Device device);
// Axes added after results were stored (tp, ep, allreduce; cuda's linear_attn and the TEST ONLY
// test_kernel) and the values
// that mean what a config without them always meant: a normalized config leaves them out at
// these values, so every earlier config string (stored results, their identities) still names
// the same run.
std::map<std::string, std::string> ImplicitAxes(Device device);

// The device a config targets (cpu when no device axis is given); InvalidArgument naming the
// device axis for a device the registry does not know. For configs from outside.
absl::StatusOr<Device> ParseConfigDevice(const BackendConfig& config);
// The device of a normalized config, whose device NormalizeBackendConfig has checked (cpu when no
// device axis is given). A device the registry does not know reads as cpu too: configs from
// outside go through ParseConfigDevice or NormalizeBackendConfig first.
Device ConfigDevice(const BackendConfig& normalized);

// Fills in defaults, leaves out tp=1, ep=off and the device's default allreduce, and rejects
// unknown axes or values (InvalidArgument naming them): a user's typo, not UNSUPPORTED.
absl::StatusOr<BackendConfig> NormalizeBackendConfig(const BackendConfig& config);

// What the machine and the model offer, for preflight.
struct PreflightTarget {
  bool has_cuda_build = false;
  int sm = 0;                   // e.g. 90 for sm_90; 0 when there is no GPU
  int gpu_count = 0;
  std::string weight_format;    // "bf16", "f16", "f32", "fp8", "nvfp4", "mxfp4"
  // The model's shapes, once known (after loading): tp and ep must shard them
  // (TensorParallelRefusal).
  std::optional<ModelConfig> model;
};

struct PreflightResult {
  bool supported = true;
  std::string reason;  // why not, when !supported: every reason that applies, joined by "; "
  PrecisionClass precision = PrecisionClass::kFp32;  // the loosest class among its backends
};

// Judges a normalized config against the target without loading anything. The registry is a
// parameter so tests can judge against a table of their own.
PreflightResult Preflight(const BackendConfig& normalized, const PreflightTarget& target,
                          const std::vector<BackendDescriptor>& registry = BackendRegistry());

// Every conflict row of the registry that a normalized config holds (with quantized conflicts
// when `weight_format` is fp8, nvfp4 or mxfp4), stated as Preflight states them, joined by "; ";
// empty when none. Preflight's own conflict judgement, for building a model without a preflight
// (CreateModel): every conflict is stated once, in the registry.
std::string RegistryConflict(const BackendConfig& normalized, std::string_view weight_format,
                             const std::vector<BackendDescriptor>& registry = BackendRegistry());

// Why `tp` ranks cannot shard `model` the way the tensor-parallel engines do (q/k/v heads, the
// dense and expert intermediate sizes, or with `expert_parallel` whole experts per rank, and the
// linear-attention heads), naming the dimension; empty when they can. KV heads fewer than the
// ranks are replicated, so the ranks must be a multiple of them. The vocabulary needs no
// divisibility: the lm_head's shards may differ by one row.
std::string TensorParallelRefusal(const ModelConfig& model, int tp, bool expert_parallel);

// The tensor-parallel axes of a normalized config: tp (1 when absent) and ep=on.
int TensorParallelRanks(const BackendConfig& normalized);
bool ExpertParallel(const BackendConfig& normalized);

// The cartesian product of per-axis value lists (each list non-empty), in a stable order.
std::vector<BackendConfig> ExpandMatrix(const std::map<std::string, std::vector<std::string>>& axes);

}  // namespace infersweep
