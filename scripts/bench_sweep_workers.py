#!/usr/bin/env python
"""Sweep throughput: the same NIAH sweep with 1 worker x T threads and with W workers x T/W threads, side by side.

Runs one Erasing-NIAH roster (``sur_lab.studies.niah``, the embedded SmolLM2-135M-Instruct by default) three ways in
fresh sweep directories and reports records per minute (wall time from the call to the consolidated records,
model loading included; the Ray instance is started once beforehand and excluded):

1. serial: ``run_sweep(..., workers=1)`` in this process with ``--threads`` torch threads (default 2);
2. Ray: ``run_sweep(..., workers=W, threads=T/W)`` (default 2 workers x 1 thread);
3. (``--kill-after K``) Ray again, with one worker process SIGKILLed from outside once K records exist; the sweep must
   complete with the same records as run 2 (every non-timing field; same thread count, so exactly the same floats).

Run 1 and run 2 use different thread counts, so their float32 reductions may round differently; the script reports
how many records agree in answer and the largest TV/NLL difference instead of asserting equality.

    .venv/bin/python scripts/bench_sweep_workers.py                          # 8 cases x 6 records, ~10 min on 2 cores
    .venv/bin/python scripts/bench_sweep_workers.py --cases 16 --kill-after 10 --also-serial-threads 1

Timings on a machine shared with other jobs are contaminated: compare the two rows of one run, not runs on different
days, and rerun on a quiet machine before quoting a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="hub id or path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cases", type=int, default=8, help="NIAH cases (>= 8 for the issue's measurement)")
    p.add_argument("--context-len", type=int, default=512, help="pre-query context, tokens")
    p.add_argument("--methods", nargs="+", default=["Shift", "Re-prefill", "SUR", "Dense tokens"])
    p.add_argument("--budgets", type=float, nargs="+", default=[5, 20])
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="total torch threads (serial run: all; Ray: split)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--also-serial-threads", type=int, nargs="*", default=[],
                   help="extra serial runs with these thread counts (e.g. 1: separates threading from the runner)")
    p.add_argument("--kill-after", type=int, default=0, help="run 3: SIGKILL one worker after K records (0: skip)")
    p.add_argument("--out", default=None, help="where the three sweep directories go (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the summary as JSON here")
    return p.parse_args(argv)


def _results(df: pd.DataFrame) -> pd.DataFrame:
    from sur_lab.analysis.stats import CONCURRENCY_FIELDS
    from sur_lab.sweeps import TIMING_FIELDS

    return df.drop(columns=[*TIMING_FIELDS, *CONCURRENCY_FIELDS]).reset_index(drop=True)


def _same(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    a, b = _results(a), _results(b)
    if list(a.columns) != list(b.columns) or len(a) != len(b):
        return False
    for col in a.columns:
        x = [v.tolist() if isinstance(v, np.ndarray) else v for v in a[col]]
        y = [v.tolist() if isinstance(v, np.ndarray) else v for v in b[col]]
        if a[col].dtype.kind == "f":
            if not np.array_equal(np.asarray(x, float), np.asarray(y, float), equal_nan=True):
                return False
        elif x != y:
            return False
    return True


def _killer(parts: Path, after: int, done: threading.Event, log: dict) -> None:
    from sur_lab.sweeps import ray as distributed

    while not done.is_set():
        n = sum(1 for f in parts.glob("*.jsonl") for _ in f.open("rb")) if parts.exists() else 0
        pids = distributed.worker_pids()
        if n >= after and pids:
            os.kill(pids[0], signal.SIGKILL)
            log.update(killed_pid=pids[0], after_records=n, at_s=time.perf_counter())
            return
        time.sleep(0.2)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from sur_lab.models import load_model
    from sur_lab.sweeps import ray as distributed
    from sur_lab.sweeps import run_sweep
    from sur_lab.studies.niah import build_niah_cases, niah_scorer, parse_niah_answer

    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_sweep_workers_"))
    model_args = {"name": args.model}
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    lm = load_model(args.model)
    serial_load = time.perf_counter() - t0
    niah = build_niah_cases(lm.tokenizer, context_lens=[args.context_len], num_cases=args.cases, seed=0)
    cases = [c.sweep_case() for c in niah]
    kw = dict(max_new_tokens=args.max_new_tokens, scorer=niah_scorer, parser=parse_niah_answer, seed=0,
              progress=True)
    print(f"{len(cases)} cases x {len(args.methods)} methods, budgets {args.budgets}; {os.cpu_count()} CPUs "
          f"(shared with other jobs: throughput numbers are contaminated)", flush=True)

    rows = []
    t0 = time.perf_counter()
    serial = run_sweep(lm, cases, args.methods, args.budgets, root / "serial", **kw)
    wall = time.perf_counter() - t0 + serial_load
    rows.append({"run": f"1 worker x {args.threads} threads", "records": len(serial), "wall_s": wall,
                 "records_per_min": distributed.records_per_minute(serial, wall)})
    for extra in args.also_serial_threads:
        torch.set_num_threads(extra)
        t0 = time.perf_counter()
        again = run_sweep(lm, cases, args.methods, args.budgets, root / f"serial_{extra}t", **kw)
        wall = time.perf_counter() - t0 + serial_load
        rows.append({"run": f"1 worker x {extra} thread(s)", "records": len(again), "wall_s": wall,
                     "records_per_min": distributed.records_per_minute(again, wall)})
    del lm

    per = max(1, args.threads // args.workers)
    distributed.init_ray(num_cpus=max(os.cpu_count() or 1, args.workers))
    t0 = time.perf_counter()
    multi = run_sweep(model_args, cases, args.methods, args.budgets, root / "ray", workers=args.workers,
                      threads=per, **kw)
    wall = time.perf_counter() - t0
    rows.append({"run": f"{args.workers} workers x {per} thread(s)", "records": len(multi), "wall_s": wall,
                 "records_per_min": distributed.records_per_minute(multi, wall)})
    ray_row = rows[-1]

    a, b = _results(serial), _results(multi)
    agree = float((a["answer"] == b["answer"]).mean())
    summary = {
        "runs": rows,
        "ratio": ray_row["records_per_min"] / rows[0]["records_per_min"],
        "answers_equal_serial_vs_ray": agree,
        "max_abs_diff_tv_reprefill": float(np.nanmax(np.abs(a["tv_reprefill"] - b["tv_reprefill"]))),
        "max_abs_diff_nll_reprefill": float(np.nanmax(np.abs(a["nll_reprefill"] - b["nll_reprefill"]))),
        "sweep_dirs": str(root),
    }
    if args.kill_after:
        done, log = threading.Event(), {}
        thread = threading.Thread(target=_killer, args=(root / "ray_kill" / "parts", args.kill_after, done, log))
        thread.start()
        t0 = time.perf_counter()
        try:
            killed = run_sweep(model_args, cases, args.methods, args.budgets, root / "ray_kill",
                               workers=args.workers, threads=per, **kw)
        finally:
            done.set()
            thread.join()
        if "at_s" in log:
            log["at_s"] = round(log["at_s"] - t0, 1)
        lines = sum(1 for f in (root / "ray_kill" / "parts").glob("*.jsonl") for _ in f.open("rb"))
        summary["kill"] = {**log, "completed_records": len(killed), "part_file_lines": lines,
                           "identical_to_uninterrupted_ray_run": _same(killed, multi),
                           "wall_s": time.perf_counter() - t0}
    import ray

    ray.shutdown()
    table = pd.DataFrame(rows)
    print(table.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
