#!/usr/bin/env python
"""Study throughput: the NIAH default sweep answered one record at a time (``eval_batch=1``) and in batches, side by
side in one process (issue 23, "Measure").

Builds the first ``--cases`` cases of the Erasing-NIAH ``default`` preset (``sur_lab.studies.niah``: 1K tokens, the
preset's references, allocators and budgets: 16 records per case) on the Qwen study model, then runs the same sweep
into fresh folders once per ``--eval-batches`` value (the first is the baseline, default 1 then the pipeline's default)
and prints, per run:

- records per minute (records / wall time of ``run_sweep``: preparation, repairs and answers; the model is loaded once
  beforehand) and the ratio to the baseline (target >= 3x); the wall time split into preparation and repairs (the
  Dirty prefill and Shift of each case, each record's selection and refresh: the same work in every run, from the
  records' own timings) and the rest, answering and scoring, with its own ratio (what batching changes);
- peak resident memory of the process during that run (``VmHWM``, reset before each run where the kernel allows it);
- for every batched run, the fraction of records whose greedy answers equal the baseline's (target >= 99 %), and every
  disagreement with the margin between the top two logits of the baseline's answer at the step where the answers
  part (a small margin means a near tie that the batched forward's rounding flipped).

    flock -x /work/cpu.lock .venv/bin/python scripts/bench_study_throughput.py             # 4 cases, ~15 min
    .venv/bin/python scripts/bench_study_throughput.py --cases 2 --eval-batches 1 8 16     # which batch size

Run it under an exclusive CPU lock: the ratio is only meaningful when nothing else shares the cores.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch


def parse_args(argv=None) -> argparse.Namespace:
    from sur_lab.runtime.cli import int_arg
    from sur_lab.sweeps import EVAL_BATCH

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="model (default: the Qwen study model)")
    p.add_argument("--preset", default="default", help="NIAH preset whose sizes the cases take (default: default)")
    p.add_argument("--cases", type=int_arg("--cases"), default=4, help="cases (>= 4 for the issue's measurement)")
    p.add_argument("--eval-batches", type=int_arg("--eval-batches"), nargs="+", default=[1, EVAL_BATCH],
                   help="eval_batch of each run; the first is the baseline (default: 1 and the pipeline default)")
    p.add_argument("--threads", type=int_arg("--threads"), default=1, help="torch threads (default 1)")
    p.add_argument("--out", default=None, help="where the sweep folders go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the summary as JSON here")
    return p.parse_args(argv)


def _reset_peak() -> bool:
    """Reset the process's peak RSS (Linux >= 4.0: writing 5 to /proc/self/clear_refs); False when not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_mb() -> float:
    """Peak resident memory of this process, MB (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _margin_where_answers_part(lm, case, method: str, budget: float, other_text: str, max_new: int):
    """Decode ``method``'s cache alone, step by step; return ``(step, margin)`` at the first step whose token makes
    the decoded text stop being a prefix of ``other_text`` (margin: top-1 minus top-2 logit there)."""
    import math

    from sur_lab.forward import decode_step, forward_tokens
    from sur_lab.repair import prepare, repair

    result = repair(lm, prepare(lm, case.edit), method, float("nan") if math.isnan(budget) else budget)
    cache = result.cache
    logits = forward_tokens(lm, case.edit.query_ids, cache, logits="last")
    eos = set(lm.eos_token_ids)
    ids: list[int] = []
    for step in range(max_new):
        top = torch.topk(logits.float(), 2)
        token = int(top.indices[0])
        margin = float(top.values[0] - top.values[1])
        text = lm.tokenizer.decode(ids + ([] if token in eos else [token]), skip_special_tokens=True).strip()
        if token in eos or not other_text.strip().startswith(text):
            return step, margin
        ids.append(token)
        logits = decode_step(lm, token, cache)
    return max_new, float("nan")


def main(argv=None) -> int:
    args = parse_args(argv)
    from sur_lab.models import load_model
    from sur_lab.studies import niah
    from sur_lab.sweeps import grid_keys, run_sweep

    torch.set_num_threads(args.threads)
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_study_throughput_"))
    sizes = niah.params(args.preset, num_cases=args.cases)
    lm = load_model(args.model)
    cases = niah.cases(lm.tokenizer, preset=args.preset, num_cases=args.cases)
    methods = niah.methods(sizes)
    budgets = sizes["budgets"]
    kw = dict(max_new_tokens=sizes["max_new_tokens"], scorer=niah.niah_scorer, parser=niah.parse_niah_answer, seed=0,
              progress=False)
    per_case = len(grid_keys(methods, budgets))
    print(f"{lm.spec.name}: {len(cases)} NIAH cases ({args.preset} preset, {sizes['context_lens']} tokens) x "
          f"{per_case} records; {args.threads} torch thread(s); max_new_tokens {sizes['max_new_tokens']}", flush=True)
    rows, runs = [], {}
    for eb in args.eval_batches:
        reset = _reset_peak()
        t0 = time.perf_counter()
        df = run_sweep(lm, cases, methods, budgets, root / f"eval_batch-{eb}", eval_batch=eb, **kw)
        wall = time.perf_counter() - t0
        runs[eb] = df
        # Preparation and repairs are the same work in every run (Dirty prefill and Shift once per case; each record's
        # selection and refresh, timed one at a time); the rest of the wall time is answering and scoring.
        by_case = df.groupby("case_id")
        repair_s = (by_case["dirty_ms"].first().sum() + by_case["shift_ms"].max().sum() + df["select_ms"].sum()
                    + df["refresh_ms"].sum()) / 1e3
        rows.append({"eval_batch": eb, "records": len(df), "wall_s": wall, "records_per_min": len(df) / wall * 60,
                     "prepare_repair_s": repair_s, "answer_s": wall - repair_s, "peak_rss_mb": _peak_mb(),
                     "peak_is_this_run": reset})
        print(f"eval_batch {eb}: {len(df)} records in {wall:.0f} s", flush=True)
    base_eb = args.eval_batches[0]
    base = runs[base_eb]
    summary = pd.DataFrame(rows)
    summary["ratio"] = summary["records_per_min"] / summary["records_per_min"].iloc[0]
    summary["answer_ratio"] = summary["answer_s"].iloc[0] / summary["answer_s"]
    disagreements = []
    agree = {}
    for eb, df in runs.items():
        if eb == base_eb:
            continue
        # pandas matches NaN budgets (the references) with NaN in merge keys.
        merged = base.merge(df, on=["case_id", "method", "budget_pct"], suffixes=("_base", "_run"), how="outer")
        same = merged["answer_base"] == merged["answer_run"]
        agree[eb] = float(same.mean())
        for row in merged[~same].itertuples():
            case = next(c for c in cases if c.case_id == row.case_id)
            step, margin = _margin_where_answers_part(lm, case, row.method, row.budget_pct, row.answer_run,
                                                      sizes["max_new_tokens"])
            disagreements.append({"eval_batch": eb, "case_id": row.case_id, "method": row.method,
                                  "budget_pct": row.budget_pct, "answer_eval_batch_1": row.answer_base,
                                  "answer_batched": row.answer_run, "parting_step": step,
                                  "top2_logit_margin": margin})
    summary["answer_agreement"] = summary["eval_batch"].map(agree)
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print()
        print(summary.round({"wall_s": 1, "records_per_min": 2, "prepare_repair_s": 1, "answer_s": 1, "peak_rss_mb": 0,
                             "ratio": 2, "answer_ratio": 2, "answer_agreement": 4}).to_string(index=False))
        print()
        if disagreements:
            print(pd.DataFrame(disagreements).to_string(index=False))
        else:
            print("no disagreements: every batched answer equals the per-record answer")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary.to_dict("records"),
                                               "disagreements": disagreements}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
