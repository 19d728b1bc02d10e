// Representative kernel entry points of each backend, for the capability probe
// (engine/cuda/capability_probe.cc): the driver is asked (cudaFuncGetAttributes) whether this
// binary holds an image of each that the GPU can run. Each is defined beside its kernel.
#pragma once

namespace infersweep::cuda {

struct ProbeKernel {
  const char* name;   // the kernel as the refusal names it
  const void* entry;  // its host-side entry point
};

ProbeKernel RmsNormProbeKernel();           // elementwise.cu: every device=cuda config
ProbeKernel FlashPrefillProbeKernel();      // attention_prefill.cu: attention=flash
ProbeKernel FlashDecodeProbeKernel();       // attention_decode.cu: attention=flash
ProbeKernel FusedGemvProbeKernel();         // gemm_fused.cu: gemm=fused and tma
ProbeKernel GemvTmaProbeKernel();           // sm90a/gemm_tma.cu: gemm=tma
ProbeKernel ExpertWgmmaProbeKernel();       // sm90a/moe_wgmma.cu: moe=wgmma
ProbeKernel PersistentDecodeProbeKernel();  // sm90a/decode_persistent.cu: graphs=persistent
ProbeKernel Sm100aTestProbeKernel();        // sm100a/test_kernel.cu: test_kernel=sm100a (TEST ONLY)

}  // namespace infersweep::cuda
