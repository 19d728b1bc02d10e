#!/usr/bin/env python3
"""The peer: HF transformers eager on qwen3-30b-a3b shapes (random bf16 weights), timed with CUDA
events on the same workloads infersweep's benchmark runs. Prints one line per figure."""
import statistics
import time

import torch
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

REPEATS = 3


def timed(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def main():
    config = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                            moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960,
                            tie_word_embeddings=False)
    t0 = time.time()
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    model.config._attn_implementation = "eager"
    print(f"# transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}, model built in {time.time() - t0:.1f} s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def decode(batch, context=512, steps=16):
        ids = torch.randint(0, 151936, (batch, context), device="cuda", generator=gen)
        with torch.no_grad():
            out = model(ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)

            def run():
                nonlocal past, nxt
                for _ in range(steps):
                    o = model(nxt, past_key_values=past, use_cache=True)
                    past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
            return batch * steps / timed(run)

    def prefill(tokens=2048):
        ids = torch.randint(0, 151936, (1, tokens), device="cuda", generator=gen)
        with torch.no_grad():
            return tokens / timed(lambda: model(ids, use_cache=False))

    for name, fn in [("decode batch 1 ctx 512", lambda: decode(1)),
                     ("decode batch 64 ctx 512", lambda: decode(64, steps=8)),
                     ("prefill 2048 tokens", prefill)]:
        fn()  # warm-up
        runs = [fn() for _ in range(REPEATS)]
        print(f"peer hf-eager {name}: median {statistics.median(runs):.1f} tok/s "
              f"(min {min(runs):.1f}, max {max(runs):.1f}, {REPEATS} repeats)", flush=True)


if __name__ == "__main__":
    main()
