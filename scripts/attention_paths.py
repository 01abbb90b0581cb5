#!/usr/bin/env python
"""Packed attention alone: the CPU paths of the packed executors on one layer's shapes, against their throughput floor.

For the benchmark grid's matched supports (``sur_lab.studies.bench.matched_support``: B positions in R intervals, M(U)
equal for every R) and the Replay sweep's b % supports (``sur_lab.budget.spread_support``, 16 intervals) this times one layer's
packed attention, ``[1, Hq, B, d]`` queries against ``[1, Hkv, N, d]`` keys, with ``sur_lab.studies.bench.
attention_only`` (interleaved rounds, medians; masks, splits, plans and compilation excluded, first calls reported
apart):

- ``sdpa-gqa``: one masked SDPA call over all keys (``packed-sdpa``);
- ``split``: the key split of ``packed-sdpa-split`` (one CPU flash call per key segment, log-sum-exp merge);
- ``onepass``: the one-pass C++ kernel of ``packed-cpp`` (each K/V tile read once for all rows that see it);
- ``flex``: compiled FlexAttention with its block mask (``packed-flex``; the first call compiles, cached on disk by
  inductor's FX graph cache afterwards);
- ``unmasked``: one unmasked flash call over the same number of row-key pairs, the floor of the issue-30 target
  (one-pass at R = 16 within 1.1x of it).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/attention_paths.py                  # SmolLM2 shapes, N = 8184
    .venv/bin/python scripts/attention_paths.py --heads 14 2 --context-len 2040 --backends split onepass unmasked

Per-layer time times the layer count is the attention share of a refresh; the rest (projections, MLP) is the same
for every R at a given B.
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
import torch

BACKENDS = ("sdpa-gqa", "split", "onepass", "flex", "unmasked")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context-len", type=int, default=8184, help="N, tokens of the edited context")
    p.add_argument("--selected", type=int, default=64, help="B, positions of the matched supports")
    p.add_argument("--intervals", type=int, nargs="*", default=[1, 4, 16], help="R values (each divides B)")
    p.add_argument("--budgets", type=float, nargs="*", default=[5.0],
                   help="b %% of the suffix for spread supports in 16 intervals (the Replay sweep's)")
    p.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"), help="query and KV heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--warmups", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.heads[0] % args.heads[1]:
        p.error(f"--heads {args.heads[0]} {args.heads[1]}: query heads must be a multiple of KV heads")
    for r in args.intervals:
        if r < 1 or args.selected % r:
            p.error(f"--intervals {r}: must be >= 1 and divide --selected {args.selected}")
    for b in args.budgets:
        if not 0 < b <= 100:
            p.error(f"--budgets {b}: must be in (0, 100]")
    if args.warmups < 0 or args.repeats < 1 or args.threads < 1:
        p.error("--warmups must be >= 0, --repeats and --threads >= 1")
    if not args.intervals and not args.budgets:
        p.error("give at least one --intervals or --budgets value")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from sur_lab.budget import allowance, spread_support
    from sur_lab.studies import bench

    torch.set_num_threads(args.threads)
    n, (hq, hkv), d = args.context_len, args.heads, args.head_dim
    common = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=getattr(torch, args.dtype), device="cpu",
                  backends=args.backends, warmups=args.warmups, repeats=args.repeats)
    supports = [(f"R = {r}", r, None) for r in args.intervals]
    s = n - bench.PREFIX_LEN
    for b in args.budgets:
        positions = spread_support(s, allowance(s, b), min(16, allowance(s, b))).absolute(bench.PREFIX_LEN)
        supports.append((f"b = {b:g} %", 16, positions))
    frames = []
    for label, r, positions in supports:
        df = bench.attention_only(n, r, num_selected=args.selected, positions=positions, **common)
        frames.append(df.assign(support=label))
        print(f"{label}: done", flush=True)
    table = pd.concat(frames, ignore_index=True)
    table["ms"] = table["median_us"] / 1e3
    order = [b for b in BACKENDS if b in set(table.backend)]
    labels = list(dict.fromkeys(table.support))
    wide = table.pivot(index="support", columns="backend", values="ms").reindex(index=labels, columns=order)
    print(f"\nN = {n}, heads {hq}/{hkv}, d = {d}, {args.dtype}, {args.threads} thread(s); median ms of "
          f"{args.repeats} interleaved rounds after {args.warmups} warm-ups (one layer, all heads)")
    print(wide.to_string(float_format="{:.2f}".format))
    if "unmasked" in wide:
        print("\nover the unmasked call over the same row-key pairs:")
        print(wide.drop(columns="unmasked").div(wide["unmasked"], axis=0).to_string(float_format="{:.3f}".format))
    print("\nrow-key pairs computed / M(U), first call (s; flex: compilation), max |error| vs the FP64 oracle:")
    detail = table.pivot(index="support", columns="backend", values=["work_over_pairs", "first_call_s",
                                                                      "max_abs_vs_fp64"]).reindex(index=labels)
    print(detail.to_string(float_format="{:.3g}".format))
    r_labels = [f"R = {r}" for r in args.intervals]
    if "R = 1" in r_labels and "R = 16" in r_labels:
        print("\nR = 16 over R = 1:", ", ".join(f"{b} {wide.loc['R = 16', b] / wide.loc['R = 1', b]:.3f}"
                                               for b in order if b != "unmasked"))
    at16 = table[table.support == "R = 16"]
    targets = bench.target_ratios(pd.DataFrame(columns=["context_len", "num_intervals", "executor", "median_ms"]),
                                  attention=at16).set_index("ratio")
    row = targets.loc["attention_R16_over_unmasked"]
    verdict = {True: "met", False: "NOT met", None: ""}[row.met]
    value = "n/a" if np.isnan(row.value) else f"{row.value:.3f}"
    print(f"\ntarget: one-pass at R = 16 within 1.1x of the unmasked call: {value} {verdict} {row.note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
