#!/usr/bin/env python3
"""Saves tiny quantized HF checkpoints in every format infersweep loads, dequantized by this
script's own torch code and run by transformers, as the fixtures of tests/quant_fixtures_test.cc.

Runs where torch and transformers are installed (the GPU machine; CPU is enough). For each
fixture a tiny random model (qwen3_moe, qwen2_moe or llama, as scripts/gen_hf_fixtures.py makes
them) is cast to bf16, and its linear layers are quantized into the exact on-disk layout of the
format's producers:
  nvfp4         ModelOpt: weight u8 [N, K/2] (low nibble = even k), weight_scale float8_e4m3fn
                [N, K/16], weight_scale_2 fp32 scalar, input_scale fp32; hf_quant_config.json
                (qwen3_moe) or config.json quantization_config quant_method modelopt (qwen2_moe)
  mxfp4         gpt-oss: weight_blocks u8 [N, K/32, 16], weight_scales u8 E8M0 [N, K/32];
                quantization_config quant_method mxfp4 (attention and router not converted)
  fp8_block128  DeepSeek-V3 / Qwen3-FP8: weight float8_e4m3fn, weight_scale_inv fp32
                [ceil(N/128), ceil(K/128)]; quantization_config quant_method fp8
  fp8_tensor    compressed-tensors (strategy tensor): weight_scale fp32 [1], input_scale
  fp8_channel   fbgemm_fp8: weight_scale fp32 [N, 1]
The embeddings, norms, router, shared-expert gate and lm_head stay bf16.

The independent implementation: each quantized linear is dequantized to fp32 here with torch
only (float8_e4m3fn's own conversion, nibbles unpacked with tensor ops through a lookup table,
E8M0 through ldexp), loaded into the transformers model in place of the dense weight, and
transformers computes fp32 eager logits on the CPU. Each folder tests/fixtures/quant/<name>/:
  config.json [+ hf_quant_config.json], model.safetensors   the quantized checkpoint
  dequantized.safetensors   torch's fp32 dequantization of every quantized linear (HF names)
  logits.npy                float32 [T, vocab], transformers on the dequantized weights
  expected.json             format, prompt, versions, quantized module names

Usage (writes ~3 MB):
  python3 scripts/gen_quant_fixtures.py [--out tests/fixtures/quant]
"""
import argparse
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_hf_fixtures import randomize, to_hub_layout  # noqa: E402  (shared tiny-model helpers)

PROMPT_LEN = 24
VOCAB = 256
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# E2M1 code -> value, codes 0..15 (bit 3 is the sign).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def tiny_configs():
    """Every input width is a multiple of 32 (mxfp4); the 160-wide MLPs span two 128-blocks."""
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
    return {
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **common, intermediate_size=160, num_hidden_layers=2, head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[0], use_sliding_window=False),
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **common, intermediate_size=160, num_hidden_layers=2, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
            use_sliding_window=False),
        "llama": transformers.LlamaConfig(**common, intermediate_size=160, num_hidden_layers=2),
    }


# ---- quantizers: amax-based scales, round to nearest even, the layouts above


def e2m1_codes(x):
    """Nearest E2M1 code of each element, ties to the even code; |x| > 6 saturates."""
    a = x.abs()
    # Ties at 0.25, 1.25, 2.5, 5 go down (onto even codes 0, 2, 4, 6), at 0.75, 1.75, 3.5 up.
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
            + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    return (code | ((x < 0).int() << 3)).to(torch.uint8)


def pack_nibbles(codes):
    """[N, K] codes -> [N, K/2] bytes, element 2j in the low nibble of byte j."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def to_e4m3(x):
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def amax_scale(amax, code_max):
    return torch.where(amax > 0, amax / code_max, torch.ones_like(amax))


def quantize_nvfp4(w):
    n, k = w.shape
    scale_2 = amax_scale(w.abs().max(), E2M1_MAX * E4M3_MAX).reshape(())
    groups = w.reshape(n, k // 16, 16)
    scale16 = to_e4m3(groups.abs().amax(-1) / E2M1_MAX / scale_2)
    effective = (scale16.float() * scale_2).unsqueeze(-1)
    scaled = torch.where(effective > 0, groups / effective, torch.zeros_like(groups))
    codes = e2m1_codes(scaled).reshape(n, k)
    # A static activation scale as ModelOpt writes one (calibrated amax / (6 * 448)); unused by
    # weight-only references, present so loaders see the real layout.
    input_scale = torch.tensor(4.0 / (E2M1_MAX * E4M3_MAX), dtype=torch.float32)
    return {"weight": pack_nibbles(codes), "weight_scale": scale16,
            "weight_scale_2": scale_2, "input_scale": input_scale}


def quantize_mxfp4(w):
    n, k = w.shape
    groups = w.reshape(n, k // 32, 32)
    amax = groups.abs().amax(-1)
    # The smallest e with 6 * 2^e >= amax: start below it and step up (a few steps at most).
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1)
    e = (exponent - 4).clamp(-127, 127)
    for _ in range(4):
        e = torch.where(torch.ldexp(torch.full_like(amax, 6.0), e) < amax, e + 1, e)
    e = torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(amax), e).unsqueeze(-1)
    codes = e2m1_codes(scaled).reshape(n, k)
    return {"weight_blocks": pack_nibbles(codes).reshape(n, k // 32, 16),
            "weight_scales": (e + 127).to(torch.uint8)}


def quantize_fp8(w, strategy):
    n, k = w.shape
    if strategy == "tensor":
        scale = amax_scale(w.abs().max(), E4M3_MAX).reshape(1)
        return {"weight": to_e4m3(w / scale), "weight_scale": scale,
                "input_scale": torch.tensor([0.05], dtype=torch.float32)}
    if strategy == "channel":
        scale = amax_scale(w.abs().amax(1, keepdim=True), E4M3_MAX)  # [N, 1]
        return {"weight": to_e4m3(w / scale), "weight_scale": scale}
    # 128 x 128 blocks; edge blocks are partial.
    bn, bk = math.ceil(n / 128), math.ceil(k / 128)
    padded = torch.zeros(bn * 128, bk * 128)
    padded[:n, :k] = w
    amax = padded.reshape(bn, 128, bk, 128).abs().amax((1, 3))
    scale_inv = amax_scale(amax, E4M3_MAX)
    full = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return {"weight": to_e4m3(w / full), "weight_scale_inv": scale_inv}


# ---- the independent dequantization: torch's float8 conversion, tensor-op nibble unpacking


def unpack_nibbles(packed, k):
    n = packed.shape[0]
    codes = torch.empty(n, k, dtype=torch.long)
    flat = packed.reshape(n, k // 2).long()
    codes[:, 0::2] = flat & 0xF
    codes[:, 1::2] = flat >> 4
    return E2M1_VALUES[codes]


def dequantize(fmt, parts, n, k):
    if fmt == "nvfp4":
        values = unpack_nibbles(parts["weight"], k)
        scale16 = parts["weight_scale"].float().repeat_interleave(16, 1)
        return (values * scale16) * parts["weight_scale_2"]  # fp32: (e2m1 * s16) * s2
    if fmt == "mxfp4":
        values = unpack_nibbles(parts["weight_blocks"], k)
        exponents = parts["weight_scales"].long() - 127
        scales = torch.ldexp(torch.ones(exponents.shape), exponents).repeat_interleave(32, 1)
        return values * scales
    codes = parts["weight"].float()
    if fmt == "fp8_block128":
        scale = parts["weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
        return codes * scale[:n, :k]
    return codes * parts["weight_scale"]  # [1] or [N, 1], broadcast


# ---- fixtures

# name: (architecture, format, declaration, HF module names kept dense (substring match))
FIXTURES = {
    "qwen3_moe_nvfp4": ("qwen3_moe", "nvfp4", "hf_quant_config", ["lm_head", "mlp.gate"]),
    "qwen2_moe_nvfp4": ("qwen2_moe", "nvfp4", "modelopt", ["lm_head", "mlp.gate",
                                                          "shared_expert_gate"]),
    "qwen3_moe_mxfp4": ("qwen3_moe", "mxfp4", "mxfp4", ["lm_head", "self_attn", "mlp.gate"]),
    "qwen3_moe_fp8_block128": ("qwen3_moe", "fp8_block128", "fp8", ["lm_head", "mlp.gate"]),
    "llama_fp8_tensor": ("llama", "fp8_tensor", "compressed-tensors", ["lm_head"]),
    "llama_fp8_channel": ("llama", "fp8_channel", "fbgemm_fp8", ["lm_head"]),
}


def declaration(kind, fmt, excluded):
    """(config.json quantization_config or None, hf_quant_config.json or None)."""
    if kind == "hf_quant_config":
        return None, {"producer": {"name": "modelopt", "version": "0.29.0"},
                      "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                       "group_size": 16, "exclude_modules": excluded}}
    if kind == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "exclude_modules": excluded}, None
    if kind == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": excluded}, None
    if kind == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128], "modules_to_not_convert": excluded}, None
    if kind == "compressed-tensors":
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                "symmetric": True, "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                          "symmetric": True, "dynamic": False}}},
                "ignore": excluded}, None
    if kind == "fbgemm_fp8":
        return {"quant_method": "fbgemm_fp8", "modules_to_not_convert": excluded}, None
    raise ValueError(kind)


def quantize(fmt, w):
    if fmt == "nvfp4":
        return quantize_nvfp4(w)
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    return quantize_fp8(w, fmt[len("fp8_"):].replace("block128", "block"))


def is_quantized(name, tensor, excluded):
    if not name.endswith(".weight") or tensor.dim() != 2 or not name.startswith("model.layers."):
        return False
    module = name[:-len(".weight")]
    return not any(e in module.split(".") or module.endswith("." + e) for e in excluded)


def build_fixture(name, arch, fmt, kind, excluded, config, out_dir, seed):
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, gen)
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        state = {}
        for f in sorted(os.listdir(tmp)):
            if f.endswith(".safetensors"):
                state.update(load_file(os.path.join(tmp, f)))
        with open(os.path.join(tmp, "config.json")) as f:
            config_json = json.load(f)
    state = to_hub_layout(state, arch)  # per-expert names, as quantized checkpoints ship

    quantized_state, dequantized, dense_fp32 = {}, {}, {}
    for tensor_name, t in sorted(state.items()):
        if not is_quantized(tensor_name, t, excluded):
            quantized_state[tensor_name] = t
            dense_fp32[tensor_name] = t.float()
            continue
        n, k = t.shape
        parts = quantize(fmt, t.float())
        module = tensor_name[:-len(".weight")]
        for suffix, part in parts.items():
            quantized_state[f"{module}.{suffix}"] = part.contiguous()
        dequantized[tensor_name] = dequantize(fmt, parts, n, k).float().contiguous()
        dense_fp32[tensor_name] = dequantized[tensor_name]

    folder = os.path.join(out_dir, name)
    os.makedirs(folder)
    quantization_config, hf_quant_config = declaration(kind, fmt, excluded)
    if quantization_config is not None:
        config_json["quantization_config"] = quantization_config
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_json, f, indent=1)
    if hf_quant_config is not None:
        with open(os.path.join(folder, "hf_quant_config.json"), "w") as f:
            json.dump(hf_quant_config, f, indent=1)
    save_file(quantized_state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, os.path.join(folder, "dequantized.safetensors"))

    # transformers on the dequantized weights: a plain fp32 checkpoint without any declaration.
    with tempfile.TemporaryDirectory() as tmp:
        plain = dict(config_json)
        plain.pop("quantization_config", None)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(plain, f)
        save_file(dense_fp32, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        ref = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                   attn_implementation="eager").eval()
        check_loaded(ref, dense_fp32, name)
        prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
        with torch.no_grad():
            logits = ref(torch.tensor([prompt])).logits[0].float().numpy()
    np.save(os.path.join(folder, "logits.npy"), logits.astype(np.float32))
    expected = {"format": fmt, "arch": arch, "declared_by": kind, "prompt": prompt,
                "quantized_linears": sorted(dequantized), "excluded": excluded,
                "max_abs_logit": float(np.abs(logits).max()),
                "transformers": transformers.__version__, "torch": torch.__version__}
    with open(os.path.join(folder, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"{name}: {len(dequantized)} quantized linears, {len(quantized_state)} tensors, "
          f"{size / 1e6:.2f} MB, max|logit| {expected['max_abs_logit']:.3f}")
    return size


def check_loaded(model, state, name):
    """transformers must hold the weights it was given (per-expert names may load fused)."""
    loaded = {k: v.detach() for k, v in model.state_dict().items()}
    checked = 0
    for key, want in state.items():
        if key in loaded:
            if not torch.equal(loaded[key].float(), want.float()):
                raise SystemExit(f"{name}: transformers changed {key} on load")
            checked += 1
    if checked < len(state) // 4:
        print(f"{name}: note: only {checked} of {len(state)} tensors kept their names on load")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/quant")
    args = ap.parse_args()
    torch.set_num_threads(8)
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    configs = tiny_configs()
    total = 0
    for index, (name, (arch, fmt, kind, excluded)) in enumerate(FIXTURES.items()):
        total += build_fixture(name, arch, fmt, kind, excluded, configs[arch], args.out,
                               2000 + index)
    print(f"total {total / 1e6:.2f} MB in {args.out}")


if __name__ == "__main__":
    main()
