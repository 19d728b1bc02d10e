// What a measured figure depends on beyond its backend config and device: the model's identity
// and the software stack it ran on (docs/RESULTS.md "Identity"). Plain types and their canonical
// key texts, shared by the engine (which describes what it loaded) and the result types.
#pragma once

#include <cstdint>
#include <string>

namespace infersweep {

// The model a result measured, beyond its model string.
struct ModelIdentity {
  std::string source;       // "preset" or "checkpoint"; empty: unknown
  std::string name;         // preset name ("tiny-moe"), or the checkpoint's absolute folder
  int layers = 0;           // the layers it ran with; 0: unknown
  uint64_t seed = 0;        // presets: the synthetic weights' seed
  std::string weights;      // the linears' format: bf16, f16, f32, fp8_channel, nvfp4, ...
  std::string fingerprint;  // checkpoints: FNV-1a 64 of config.json and the safetensors headers
};

// Canonical text, the key results are grouped by: "preset:tiny-moe layers=2 seed=1 weights=bf16",
// "checkpoint:/models/q3 layers=48 weights=nvfp4 fp=0123456789abcdef"; "" when unknown.
inline std::string ModelIdentityKey(const ModelIdentity& m) {
  if (m.source.empty() || m.name.empty()) return "";
  std::string key = m.source + ":" + m.name;
  if (m.layers > 0) key += " layers=" + std::to_string(m.layers);
  if (m.source == "preset") key += " seed=" + std::to_string(m.seed);
  if (!m.weights.empty()) key += " weights=" + m.weights;
  if (!m.fingerprint.empty()) key += " fp=" + m.fingerprint;
  return key;
}

// The libraries a GPU result ran on, as they report their versions; "" where not linked or not
// applicable (all empty on the CPU).
struct SoftwareStack {
  std::string driver;        // the NVIDIA driver, e.g. "580.65.06"
  std::string cuda_driver;   // the CUDA version the driver supports, e.g. "13.0"
  std::string cuda_runtime;  // e.g. "13.0"
  std::string cublas;        // e.g. "13.0.0"
  std::string cublaslt;
  std::string nccl;
  std::string cudnn;
};

// "driver=580.65.06 cuda=13.0/13.0 cublas=13.0.0 cublasLt=13.0.0"; "" when all are empty.
inline std::string SoftwareStackKey(const SoftwareStack& s) {
  std::string key;
  auto add = [&key](const char* name, const std::string& value) {
    if (value.empty()) return;
    if (!key.empty()) key += ' ';
    key += name;
    key += '=';
    key += value;
  };
  add("driver", s.driver);
  if (!s.cuda_driver.empty() || !s.cuda_runtime.empty())
    add("cuda", (s.cuda_driver.empty() ? "?" : s.cuda_driver) + "/" +
                    (s.cuda_runtime.empty() ? "?" : s.cuda_runtime));
  add("cublas", s.cublas);
  add("cublasLt", s.cublaslt);
  add("nccl", s.nccl);
  add("cudnn", s.cudnn);
  return key;
}

}  // namespace infersweep
