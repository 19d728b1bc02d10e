#!/usr/bin/env python3
"""Saves tiny random HF checkpoints of every supported architecture with transformers, and the
logits transformers computes on them in fp32, as test fixtures for the engine.

Runs where torch and transformers are installed (the GPU machine); CI only reads its output.
Every checkpoint is bf16 safetensors with non-trivial norm gains and biases. For each one:
  tests/fixtures/hf/<name>/config.json, model.safetensors (as transformers saved it)
  tests/fixtures/hf/<name>/logits.npy   float32 [T, vocab], transformers fp32 eager, CPU
  tests/fixtures/hf/<name>/expected.json prompt, 12 greedy tokens, versions, tensor names
One MoE checkpoint is also rewritten in the Hub's per-expert layout, sharded with an index, to
cover that loading path on the same weights (its logits are the same file's).

The hybrids (qwen3_next, qwen3_5_moe: Gated DeltaNet + gated attention + MoE with a shared
expert) get zero-centred decoder norms of 0 +- 0.2, plain linear-attention norm gains of
1 +- 0.2, A_log = log(uniform(1, 16)) and dt_bias ~ 0.5 N(0, 1), and prompts of HYBRID_PROMPT_LEN
tokens so that the prefill crosses a chunk boundary of the chunked delta rule (64). A transformers
without a hybrid's model class skips it with a message.

Usage: python3 scripts/gen_hf_fixtures.py [--out tests/fixtures/hf] [--only qwen3_next,qwen3_5_moe]
(--only regenerates the named fixtures and leaves the other folders as they are; each fixture's
seed depends on its place in the full list, not on --only.)
"""
import argparse
import json
import math
import os
import shutil

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

PROMPT_LEN = 40
HYBRID_PROMPT_LEN = 80
GREEDY_STEPS = 12
VOCAB = 320


def tiny_configs():
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    return {
        # llama with tied embeddings and attention biases (q/k/v and o)
        "llama": transformers.LlamaConfig(**common, intermediate_size=128, num_hidden_layers=2,
                                          tie_word_embeddings=True, attention_bias=True),
        # qwen3 dense: q/k norm, explicit head_dim different from hidden/heads
        "qwen3": transformers.Qwen3Config(**common, intermediate_size=128, num_hidden_layers=2,
                                          head_dim=32, tie_word_embeddings=False,
                                          use_sliding_window=False),
        # qwen2_moe: shared expert with sigmoid gate, qkv bias, a dense layer via mlp_only_layers
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **common, intermediate_size=96, num_hidden_layers=3, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
            tie_word_embeddings=False, use_sliding_window=False),
        # qwen3_moe: q/k norm, renormalised top-k, decoder_sparse_step 2 (layers 1 and 3 MoE)
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **common, intermediate_size=96, num_hidden_layers=4, head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            decoder_sparse_step=2, mlp_only_layers=[], tie_word_embeddings=False,
            use_sliding_window=False),
        # mixtral: block_sparse_moe / w1 w2 w3 on the Hub, always renormalised
        "mixtral": transformers.MixtralConfig(**common, intermediate_size=48, num_hidden_layers=2,
                                              num_local_experts=4, num_experts_per_tok=2,
                                              tie_word_embeddings=False, sliding_window=None),
    }


def hybrid_configs():
    """Tiny hybrids; each is skipped (with a message) where transformers lacks its classes."""
    out = {}
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, num_hidden_layers=4,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, tie_word_embeddings=False)
    # qwen3_next: grouped in_proj_qkvz / in_proj_ba, layers 1 and 3 full attention (interval
    # 2), a dense layer via mlp_only_layers, partial RoPE 0.25 of head_dim 16
    cls = getattr(transformers, "Qwen3NextConfig", None)
    if cls is None:
        print(f"qwen3_next: skipped: transformers {transformers.__version__} has no "
              "Qwen3NextConfig (needs >= 4.57)")
    else:
        try:
            out["qwen3_next"] = cls(**common, head_dim=16, intermediate_size=96,
                                    full_attention_interval=2, norm_topk_prob=True,
                                    decoder_sparse_step=1, mlp_only_layers=[2],
                                    partial_rotary_factor=0.25)
        except (TypeError, ValueError) as e:
            print(f"qwen3_next: skipped: Qwen3NextConfig rejects the tiny config: {e}")
    # qwen3_5_moe (text model): flat in_proj_qkv / z / b / a, explicit layer_types, multimodal
    # RoPE sections that text positions reduce to 1-D RoPE
    cls = getattr(transformers, "Qwen3_5MoeTextConfig", None)
    if cls is None:
        print(f"qwen3_5_moe: skipped: transformers {transformers.__version__} has no "
              "Qwen3_5MoeTextConfig (needs 5.x with qwen3_5_moe)")
    else:
        layer_types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
        try:
            out["qwen3_5_moe"] = cls(**common, head_dim=32, layer_types=layer_types,
                                     rope_parameters={"rope_type": "default",
                                                      "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.25,
                                                      "mrope_section": [2, 1, 1],
                                                      "mrope_interleaved": True})
        except (TypeError, ValueError) as e:
            print(f"qwen3_5_moe: skipped: Qwen3_5MoeTextConfig rejects the tiny config: {e}")
    return out


def model_for(config):
    """The causal-LM class of a config (text-only Qwen3.5 MoE is not in the Auto mapping
    everywhere)."""
    if config.model_type == "qwen3_5_moe_text":
        cls = getattr(transformers, "Qwen3_5MoeForCausalLM", None)
        if cls is not None:
            return cls
    return AutoModelForCausalLM


def randomize_hybrid(model, gen):
    """Hybrid-specific parameters; the rest as randomize() does."""
    randomize(model, gen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # plain gain of the gated norm
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):  # decoder norms scale by (1 + w)
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def randomize(model, gen):
    """Weights with realistic scale: linears var 1/fan_in, norm gains 1 +- 0.2, biases 0.2."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                # Tied embeddings double as the lm_head: keep logits O(1) so greedy decoding
                # does not collapse onto the prompt's own tokens.
                std = 1 / math.sqrt(p.shape[-1]) if model.config.tie_word_embeddings else 1.0
                p.copy_(std * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def hf_logits_and_greedy(model, prompt):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        logits = model(ids).logits[0].float().numpy()
        seq = list(prompt)
        greedy = []
        for _ in range(GREEDY_STEPS):  # full recompute each step: no cache, no generate() quirks
            nxt = int(torch.argmax(model(torch.tensor([seq])).logits[0, -1]))
            greedy.append(nxt)
            seq.append(nxt)
    return logits, greedy


def to_hub_layout(state, arch):
    """Per-expert tensors under the Hub's names (Mixtral: block_sparse_moe + w1/w3/w2)."""
    out = {}
    for name, t in state.items():
        parts = name.split(".")
        if ".mlp.experts.gate_up_proj" in name or ".mlp.experts.down_proj" in name:
            prefix = name.split(".mlp.experts.")[0]
            fused = name.split(".mlp.experts.")[1].split(".")[0]
            for e in range(t.shape[0]):
                if fused == "gate_up_proj":
                    inter = t.shape[1] // 2
                    out[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                    out[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = t[e, inter:].contiguous()
                else:
                    out[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    if arch == "mixtral":
        renamed = {}
        for name, t in out.items():
            name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            name = name.replace(".mlp.experts.", ".block_sparse_moe.experts.")
            name = name.replace(".gate_proj.", ".w1.").replace(".up_proj.", ".w3.")
            name = name.replace(".down_proj.", ".w2.")
            renamed[name] = t
        out = renamed
    return out


def write_sharded(state, folder, shards=2):
    names = sorted(state)
    per = (len(names) + shards - 1) // shards
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {n: state[n] for n in names[i * per:(i + 1) * per]}
        save_file(chunk, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/hf")
    ap.add_argument("--only", default="", help="comma-separated fixture names to regenerate")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    torch.set_num_threads(8)
    torch.backends.cuda.matmul.allow_tf32 = False
    if not only:
        shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    summary = {}
    hybrids = hybrid_configs()
    configs = dict(tiny_configs(), **hybrids)
    for index, (arch, config) in enumerate(configs.items()):
        if only and arch not in only:
            continue
        folder = os.path.join(args.out, arch)
        for stale in (folder, folder + "_hub_sharded"):
            shutil.rmtree(stale, ignore_errors=True)
        gen = torch.Generator().manual_seed(1000 + index)
        model_cls = model_for(config)
        model = model_cls.from_config(config, dtype=torch.float32) \
            if model_cls is AutoModelForCausalLM else model_cls(config).to(torch.float32)
        if arch in hybrids:
            randomize_hybrid(model, gen)
        else:
            randomize(model, gen)
        model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(folder, extra)):
                os.remove(os.path.join(folder, extra))
        # The reference run: the saved bf16 files, loaded in fp32, eager attention, on the CPU.
        ref = model_cls.from_pretrained(folder, dtype=torch.float32,
                                        attn_implementation="eager").eval()
        prompt_len = HYBRID_PROMPT_LEN if arch in hybrids else PROMPT_LEN
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist()
        logits, greedy = hf_logits_and_greedy(ref, prompt)
        np.save(os.path.join(folder, "logits.npy"), logits.astype(np.float32))
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        names = sorted(n for f in files for n in load_file(os.path.join(folder, f)))
        expected = {"arch": arch, "prompt": prompt, "greedy": greedy,
                    "max_abs_logit": float(np.abs(logits).max()),
                    "transformers": transformers.__version__, "torch": torch.__version__,
                    "tensor_names": names}
        with open(os.path.join(folder, "expected.json"), "w") as f:
            json.dump(expected, f, indent=1)
        summary[arch] = {"greedy": greedy, "max_abs_logit": expected["max_abs_logit"],
                         "files": files, "n_tensors": len(names)}
        print(f"{arch}: {len(names)} tensors in {files}; first names {names[:3]} ...; "
              f"greedy {greedy}")

        if arch in ("qwen3_moe", "mixtral"):  # the Hub's per-expert layout, sharded
            hub = os.path.join(args.out, arch + "_hub_sharded")
            os.makedirs(hub)
            state = {}
            for f in files:
                state.update(load_file(os.path.join(folder, f)))
            write_sharded(to_hub_layout(state, arch), hub)
            shutil.copy(os.path.join(folder, "config.json"), hub)
            # Same weights, so transformers must agree: check it rather than assume it.
            hub_ref = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
            hub_logits, hub_greedy = hf_logits_and_greedy(hub_ref, prompt)
            diff = float(np.abs(hub_logits - logits).max())
            print(f"{arch}_hub_sharded: transformers reload max|diff| vs saved layout {diff:g}")
            np.save(os.path.join(hub, "logits.npy"), hub_logits.astype(np.float32))
            hub_names = sorted(n for f in os.listdir(hub) if f.endswith(".safetensors")
                               for n in load_file(os.path.join(hub, f)))
            with open(os.path.join(hub, "expected.json"), "w") as f:
                json.dump(dict(expected, greedy=hub_greedy, tensor_names=hub_names,
                               max_abs_logit=float(np.abs(hub_logits).max())), f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
