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

}  // namespace

std::string CompressResultJson(std::string_view json) {
  z_stream z{};
  // Level 6 (zlib's default): 10-20 us for a 2-4 KB result; level 1 saves little time and ~15 %
  // of the ratio.
  if (deflateInit(&z, 6) != Z_OK) return "";
  deflateSetDictionary(&z, DictionaryBytes(), static_cast<uInt>(kResultDictionaryV1.size()));
  std::string out(1 + deflateBound(&z, static_cast<uLong>(json.size())), '\0');
  out[0] = static_cast<char>(kTagDeflateV1);
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(json.data()));
  z.avail_in = static_cast<uInt>(json.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data() + 1);
  z.avail_out = static_cast<uInt>(out.size() - 1);
  const int rc = deflate(&z, Z_FINISH);
  out.resize(1 + z.total_out);
  deflateEnd(&z);
  // deflateBound guarantees room: Z_FINISH completes in one call.
  return rc == Z_STREAM_END ? out : std::string();
}

absl::StatusOr<std::string> DecompressResultJson(std::string_view blob) {
  if (blob.empty()) return absl::DataLossError("stored result: empty blob");
  if (static_cast<unsigned char>(blob[0]) != kTagDeflateV1)
    return absl::DataLossError(absl::StrCat("stored result: unknown codec tag ",
                                            static_cast<int>(static_cast<unsigned char>(blob[0])),
                                            " (a newer infersweep wrote it?)"));
  z_stream z{};
  if (inflateInit(&z) != Z_OK) return absl::ResourceExhaustedError("zlib: inflateInit failed");
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(blob.data() + 1));
  z.avail_in = static_cast<uInt>(blob.size() - 1);
  std::string out;
  out.resize(blob.size() * 8 + 1024);
  int rc = Z_OK;
  for (;;) {
    z.next_out = reinterpret_cast<Bytef*>(out.data() + z.total_out);
    z.avail_out = static_cast<uInt>(out.size() - z.total_out);
    rc = inflate(&z, Z_NO_FLUSH);
    if (rc == Z_NEED_DICT) {
      rc = inflateSetDictionary(&z, DictionaryBytes(),
                                static_cast<uInt>(kResultDictionaryV1.size()));
      if (rc != Z_OK) break;
      continue;
    }
    if (rc == Z_STREAM_END) break;
    if (rc != Z_OK && rc != Z_BUF_ERROR) break;
    if (z.avail_out == 0) {
      out.resize(out.size() * 2);
      continue;
    }
    if (z.avail_in == 0) {  // input ends before the stream does
      rc = Z_DATA_ERROR;
      break;
    }
  }
  const size_t produced = z.total_out;
  const std::string msg = z.msg != nullptr ? z.msg : "truncated stream";
  inflateEnd(&z);
  if (rc != Z_STREAM_END)
    return absl::DataLossError(
        absl::StrCat("stored result: damaged compressed JSON (zlib: ", msg, ")"));
  out.resize(produced);
  return out;
}

}  // namespace infersweep
