#!/usr/bin/env python
"""Profile one packed refresh with torch.profiler (issue 17, lean per-layer path): the top CPU operators.

Embedded SmolLM2-135M by default, N = 8184 (an 8,192-token original context), B = 64 in R = 16 matched intervals
(``sur_lab.studies.bench``), one thread, the default executor in place (``packed-inplace``: on a CPU the one-pass C++
kernel, whose operator is ``sur_lab_onepass::attention``). Prints the profiler's operator table sorted by self CPU
time; on a shared machine compare percentages, not ms.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/profile_packed_refresh.py --intervals 16
    OMP_NUM_THREADS=1 .venv/bin/python scripts/profile_packed_refresh.py --executor packed-sdpa-split-inplace

An older commit is profiled by putting its checkout first on the path (the script also runs on the pre-layout
package, e.g. 1af7246, the state when issue 17 was filed):

    git worktree add /tmp/before 1af7246
    PYTHONPATH=/tmp/before .venv/bin/python scripts/profile_packed_refresh.py --executor packed --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="hub id or path; default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--context-len", type=int, default=8184, help="N, tokens of the edited context")
    parser.add_argument("--num-selected", type=int, default=64, help="B, positions")
    parser.add_argument("--intervals", type=int, default=16, help="R")
    parser.add_argument("--executor", default="packed-inplace", help="registered executor name")
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--rows", type=int, default=20, help="operator rows printed")
    parser.add_argument("--shapes", action="store_true", help="record input shapes and group the table by them")
    args = parser.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from sur_lab.cache_ops import clone_cache
    from sur_lab.executors import get_executor
    from sur_lab.models import load_model

    try:
        from sur_lab.executors import executor_consumes_input
        from sur_lab.studies import bench
    except ImportError:  # a commit before the package layout (issue 11), for "before" profiles: no in-place forms
        from sur_lab import bench

        def executor_consumes_input(name: str) -> bool:
            return False

    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    ctx = bench.prepare_context(lm, args.context_len)
    support = bench.matched_support(args.context_len, ctx.edit.prefix_len, args.num_selected, args.intervals)
    fn = get_executor(args.executor)
    consumes = executor_consumes_input(args.executor)
    for _ in range(args.warmups):
        fn(lm, clone_cache(ctx.shift) if consumes else ctx.shift, ctx.edit, support)
    cache = clone_cache(ctx.shift) if consumes else ctx.shift
    with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
        t0 = time.perf_counter()
        fn(lm, cache, ctx.edit, support)
        wall_ms = (time.perf_counter() - t0) * 1e3
    ops_ms = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
    print(f"{args.executor}, N={args.context_len}, B={args.num_selected}, R={args.intervals}, "
          f"threads {torch.get_num_threads()}: wall {wall_ms:.1f} ms under the profiler, operators' self time "
          f"{ops_ms:.1f} ms, outside operators (Python, dispatch) {100 * (1 - ops_ms / wall_ms):.1f} %")
    averages = prof.key_averages(group_by_input_shape=args.shapes)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
