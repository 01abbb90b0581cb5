#!/usr/bin/env python
"""Packed attention alone: the CPU paths of ``packed-sdpa`` and ``packed-sdpa-split`` on one layer's shapes.

For the benchmark grid's matched supports (``sur_lab.studies.bench.matched_support``: B positions in R intervals,
M(U) equal for every R) this times one layer's packed attention, ``[1, Hq, B, d]`` queries against ``[1, Hkv, u_B + 1,
d]`` keys, four ways, interleaved, and prints medians in ms:

- ``single-gqa``: one masked ``F.scaled_dot_product_attention(enable_gqa=True)`` call over keys ``[0, u_B]``
  (``packed-sdpa``);
- ``split``: what ``packed-sdpa-split`` runs: the key split (:func:`sur_lab.executors.packed.split_segments`
  segments, GQA folded into the query rows, one CPU flash call per segment, log-sum-exp merge);
- ``split-1``: the same folded flash op as a single call over ``[0, u_B]``;
- ``pairs``: the row-key pairs each path computes, against M(U).

    .venv/bin/python scripts/attention_paths.py                     # SmolLM2 shapes (Hq 9, Hkv 3, d 64), N = 8184
    .venv/bin/python scripts/attention_paths.py --heads 14 2 --context-len 2040 --intervals 1 4 16

Per-layer time times the layer count is the attention share of a refresh; the rest (projections, MLP) is the same
for every R at a given B.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context-len", type=int, default=8184, help="N, tokens of the edited context")
    p.add_argument("--selected", type=int, default=64, help="B, positions refreshed")
    p.add_argument("--intervals", type=int, nargs="+", default=[1, 4, 16], help="R values (each divides B)")
    p.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"), help="query and KV heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.heads[0] % args.heads[1]:
        p.error(f"--heads {args.heads[0]} {args.heads[1]}: query heads must be a multiple of KV heads")
    for r in args.intervals:
        if r < 1 or args.selected % r:
            p.error(f"--intervals {r}: must be >= 1 and divide --selected {args.selected}")
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be >= 1")
    return args


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def main(argv=None) -> int:
    args = parse_args(argv)
    from sur_lab.executors import packed
    from sur_lab.studies.bench import PREFIX_LEN, matched_support

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    hq, hkv = args.heads
    n, b, d = args.context_len, args.selected, args.head_dim
    k = torch.randn(1, hkv, n, d, generator=gen)
    v = torch.randn(1, hkv, n, d, generator=gen)
    q = torch.randn(1, hq, b, d, generator=gen)
    scale = d**-0.5
    rows = []
    for r in args.intervals:
        support = matched_support(n, PREFIX_LEN, b, r)
        u = torch.as_tensor(np.asarray(support.positions) + PREFIX_LEN)
        kv_len = int(u[-1]) + 1
        group = hq // hkv
        # What packed-sdpa and packed-sdpa-split (= packed on a CPU) run.
        single = packed._make_attention("sdpa", u, kv_len, torch.float32, flex_compile=False, num_kv_groups=group)
        split = packed._make_attention("sdpa", u, kv_len, torch.float32, flex_compile=False, sdpa_split=True,
                                       num_kv_groups=group)
        segments = [seg for seg, _ in split.segments]
        whole = packed._segment_masks(u, [packed.KeySegment(0, 0, kv_len, 0)], torch.float32, group)
        kk, vv = k[:, :, :kv_len], v[:, :, :kv_len]
        timings = {"single-gqa": lambda: single.attend(q, kk, vv, scale),
                   "split": lambda: split.attend(q, kk, vv, scale),
                   "split-1": lambda: packed._split_sdpa(q, kk, vv, whole, scale)}
        medians = {name: [] for name in timings}
        for _ in range(3):  # interleaved rounds
            for name, fn in timings.items():
                medians[name].append(_median_ms(fn, args.repeats))
        m_u = int(torch.sum(u + 1))
        pairs = sum((b - seg.call_row) * (seg.key_end - seg.key_start) for seg in segments)  # padding rows too
        rows.append({"R": r, "segments": len(segments), "u_B + 1": kv_len,
                     **{f"{name} (ms)": round(float(np.median(v)), 2) for name, v in medians.items()},
                     "split pairs / M(U)": round(pairs / m_u, 3), "single pairs / M(U)": round(b * kv_len / m_u, 3)})
    import pandas as pd

    print(f"N = {n}, B = {b}, heads {hq}/{hkv}, d = {d}, {args.threads} thread(s); medians of 3 x {args.repeats}")
    print(pd.DataFrame(rows).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
