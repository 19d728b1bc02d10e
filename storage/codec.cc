#include "storage/codec.h"

#include <zlib.h>

#include "absl/strings/str_cat.h"

namespace infersweep {
namespace {

constexpr unsigned char kTagDeflateV1 = 0x01;

// The preset dictionary of codec 1: a result's field names and frequent values in the order
// ToJson(TrialResult) writes them (nlohmann sorts keys), the most frequent last, where deflate
// finds them nearest. Stored results depend on these exact bytes: never edit it; a better
// dictionary is a new tag.
constexpr std::string_view kResultDictionaryV1 =
    R"({"attempt":1,"batches":[{"achieved_gb_s":,"avg_power_w":null,"batch":1,)"
    R"("decode_bytes_per_step":,"itl_ms":{"p50":,"p90":,"p99":},"joules_per_output_token":null,)"
    R"("kernels":{"decode":{"fallbacks":[],"graph":false,"launches":[{"count":1,"name":""}]},)"
    R"("prefill":{"fallbacks":[],"graph":false,"launches":[{"count":1,"name":""}]}},)"
    R"("latency_ms":{"max":,"median":,"min":},"output_tok_s":{"max":,"median":,"min":},)"
    R"("output_tok_s_per_seq":{"max":,"median":,"min":},"prefill_flops":,)"
    R"("prefill_roofline_fraction":null,"prefill_roofline_tok_s":null,)"
    R"("prefill_tok_s":{"max":,"median":,"min":},"roofline_fraction":null,"roofline_tok_s":null,)"
    R"("timer":"cuda_events","tpot_ms":{"max":,"median":,"min":},"ttft_ms":{"max":,"median":,)"
    R"("min":},"wall_tpot_ms":null,"wall_ttft_ms":null}],"config":{"attention":"flash",)"
    R"("device":"cuda","gemm":"fused","graphs":"on","kv_cache":"bf16","moe":"fused",)"
    R"("qgemm":"w4a16","matmul":"blocked","threads":"all"},"device":"NVIDIA H200",)"
    R"("engine_version":"infersweep ","finished_unix_ms":17,"graph_capture_seconds":0.0,)"
    R"("load_seconds":,"model":"preset:qwen3-30b-a3b","model_identity":{"fingerprint":"",)"
    R"("key":"preset:qwen3-30b-a3b layers=48 seed=1 weights=bf16","layers":48,)"
    R"("name":"qwen3-30b-a3b","seed":1,"source":"preset","weights":"bf16"},)"
    R"("peak_memory_bytes":,"reason":"","sm":90,"software":{"cublas":"13.0.0",)"
    R"("cublaslt":"13.0.0","cuda_driver":"13.0","cuda_runtime":"13.0","cudnn":"",)"
    R"("driver":"","nccl":""},"started_unix_ms":17,"status":"OK","stderr_tail":"",)"
    R"("trial_id":"","verdict":{"degenerate":false,"failures":[],"free_run_agreement":1.0,)"
    R"("kl_max":,"kl_mean":,"loop_reference_agreement":null,"max_rel_error":,"non_finite":0,)"
    R"("precision_class":"bf16","reference_degenerate":false,"top1_agreement":1.0,)"
    R"("worst_pass":"decode at batch 1","worst_pass_kl_mean":},"workload":"prompt=128,)"
    R"(output=32,warmup=1"},{"max":0.0,"median":0.0,"min":0.0},{"max":0.0,"median":0.0,"min":)";

const Bytef* DictionaryBytes() {
  return reinterpret_cast<const Bytef*>(kResultDictionaryV1.data());
}

// One deflate state per thread, reset for each result: deflateInit allocates ~270 KB, which
// cost more than compressing a result.
class Deflater {
 public:
  Deflater() { ok_ = deflateInit(&z_, 6) == Z_OK; }
  ~Deflater() {
    if (ok_) deflateEnd(&z_);
  }
  // Level 6 (zlib's default): a 2-4 KB result is small, so a faster level would save little
  // time and give up part of the ratio.
  std::string Compress(std::string_view json) {
    if (!ok_ || deflateReset(&z_) != Z_OK) return "";
    deflateSetDictionary(&z_, DictionaryBytes(), static_cast<uInt>(kResultDictionaryV1.size()));
    std::string out(1 + deflateBound(&z_, static_cast<uLong>(json.size())), '\0');
    out[0] = static_cast<char>(kTagDeflateV1);
    z_.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(json.data()));
    z_.avail_in = static_cast<uInt>(json.size());
    z_.next_out = reinterpret_cast<Bytef*>(out.data() + 1);
    z_.avail_out = static_cast<uInt>(out.size() - 1);
    // deflateBound guarantees room: Z_FINISH completes in one call.
    if (deflate(&z_, Z_FINISH) != Z_STREAM_END) return "";
    out.resize(1 + z_.total_out);
    return out;
  }

 private:
  z_stream z_{};
  bool ok_ = false;
};

}  // namespace

std::string CompressResultJson(std::string_view json) {
  thread_local Deflater deflater;
  return deflater.Compress(json);
}

namespace {

// One inflate state per thread, reset for each result (inflateInit allocates its window).
class Inflater {
 public:
  Inflater() { ok_ = inflateInit(&z_) == Z_OK; }
  ~Inflater() {
    if (ok_) inflateEnd(&z_);
  }
  absl::StatusOr<std::string> Inflate(std::string_view stream) {
    if (!ok_ || inflateReset(&z_) != Z_OK)
      return absl::ResourceExhaustedError("zlib: inflateInit failed");
    z_.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(stream.data()));
    z_.avail_in = static_cast<uInt>(stream.size());
    std::string out;
    out.resize(stream.size() * 8 + 1024);
    int rc = Z_OK;
    for (;;) {
      z_.next_out = reinterpret_cast<Bytef*>(out.data() + z_.total_out);
      z_.avail_out = static_cast<uInt>(out.size() - z_.total_out);
      rc = inflate(&z_, Z_NO_FLUSH);
      if (rc == Z_NEED_DICT) {
        rc = inflateSetDictionary(&z_, DictionaryBytes(),
                                  static_cast<uInt>(kResultDictionaryV1.size()));
        if (rc != Z_OK) break;
        continue;
      }
      if (rc == Z_STREAM_END) break;
      if (rc != Z_OK && rc != Z_BUF_ERROR) break;
      if (z_.avail_out == 0) {
        out.resize(out.size() * 2);
        continue;
      }
      if (z_.avail_in == 0) {  // input ends before the stream does
        rc = Z_DATA_ERROR;
        break;
      }
    }
    if (rc != Z_STREAM_END)
      return absl::DataLossError(absl::StrCat("stored result: damaged compressed JSON (zlib: ",
                                              z_.msg != nullptr ? z_.msg : "truncated stream",
                                              ")"));
    out.resize(z_.total_out);
    return out;
  }

 private:
  z_stream z_{};
  bool ok_ = false;
};

}  // namespace

absl::StatusOr<std::string> DecompressResultJson(std::string_view blob) {
  if (blob.empty()) return absl::DataLossError("stored result: empty blob");
  if (static_cast<unsigned char>(blob[0]) != kTagDeflateV1)
    return absl::DataLossError(absl::StrCat("stored result: unknown codec tag ",
                                            static_cast<int>(static_cast<unsigned char>(blob[0])),
                                            " (a newer infersweep wrote it?)"));
  thread_local Inflater inflater;
  return inflater.Inflate(blob.substr(1));
}

namespace {
constexpr std::string_view kKernelsRef = "\"kernels_ref\":";
}  // namespace

std::string StripKernelLogRefs(std::string text) {
  size_t at = text.find(kKernelsRef);
  if (at == std::string::npos) return text;
  std::string out;
  out.reserve(text.size());
  size_t from = 0;
  for (; at != std::string::npos; at = text.find(kKernelsRef, from)) {
    size_t end = at + kKernelsRef.size();
    while (end < text.size() && text[end] >= '0' && text[end] <= '9') ++end;
    size_t begin = at;
    if (end < text.size() && text[end] == ',') {
      ++end;  // "kernels_ref":3,"latency_ms":... -> "latency_ms":...
    } else if (begin > from && text[begin - 1] == ',') {
      --begin;  // ...,"kernels_ref":3} -> ...}
    }
    out.append(text, from, begin - from);
    from = end;
  }
  out.append(text, from, std::string::npos);
  return out;
}

absl::StatusOr<std::string> ExpandKernelLogRefs(
    std::string text, const std::function<absl::StatusOr<std::string>(int64_t)>& log) {
  constexpr std::string_view kRef = kKernelsRef;
  size_t at = text.find(kRef);
  if (at == std::string::npos) return text;
  std::string out;
  out.reserve(text.size() * 2);
  size_t from = 0;
  for (; at != std::string::npos; at = text.find(kRef, from)) {
    size_t end = at + kRef.size();
    int64_t id = 0;
    while (end < text.size() && text[end] >= '0' && text[end] <= '9')
      id = id * 10 + (text[end++] - '0');
    absl::StatusOr<std::string> body = log(id);
    if (!body.ok()) return body.status();
    out.append(text, from, at - from);
    out.append("\"kernels\":");
    out.append(*body);
    from = end;
  }
  out.append(text, from, std::string::npos);
  return out;
}

}  // namespace infersweep
