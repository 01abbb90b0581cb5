#!/usr/bin/env python
"""Study throughput: the NIAH default sweep answered one record at a time (``eval_batch=1``) and in batches, side by
side in one process (issue 23, "Measure"), with a breakdown of where a case's time goes.

Builds the first ``--cases`` cases of the Erasing-NIAH ``default`` preset (``sur_lab.studies.niah``: the preset's
references, allocators and budgets, 16 records per case; at ``--context-lens``, default 1K tokens) on the Qwen study
model, then runs the same sweep into fresh folders once per ``--runs`` entry ``EVAL_BATCH[:EXECUTOR]`` (the first is
the baseline; default: ``1``, the pipeline's default batch, and that batch with the budgeted refreshes on the
``packed`` executor) and prints, per run:

- records per minute (records / wall time of ``run_sweep``: preparation, repairs and answers; the model is loaded once
  beforehand) and the ratio to the baseline (target >= 3x);
- where the time goes, seconds per case: the Dirty prefill and its Shift (``prepare``), the Replay and Re-prefill
  references (their rebuilds), the budgeted repairs (selection + refresh, all allocators and budgets), from the
  records' own timings; the answer's query forward, greedy decode and teacher-forced scoring, measured around
  :class:`sur_lab.answer.AnswerBatch` (batch wall times, summed); and the rest (stacking, endpoints, the store);
- peak resident memory of the process during that run (``VmHWM``, reset before each run where the kernel allows it);
- for every run after the first, the fraction of records whose greedy answers equal the baseline's (target >= 99 %),
  and every disagreement with the margin between the top two logits of the baseline's answer at the step where the
  answers part (a small margin means a near tie that the batched forward's or the executor's rounding flipped).

Every run makes the same repairs (the same supports); the runs differ only in how the caches are answered, and a run
with another executor in how the budgeted refreshes are computed (``packed``: one traversal, equal to the sequential
reference up to float rounding; its records say ``executor = "packed"``). Latency is not measured here: a batched
run's answer timings are NaN by design (timing honesty, ``docs/pipeline.md``).

    flock -x /work/cpu.lock .venv/bin/python scripts/bench_study_throughput.py             # 4 cases, ~12 min
    .venv/bin/python scripts/bench_study_throughput.py --cases 2 --runs 1 8 16 16:packed   # which batch size

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
    p.add_argument("--context-lens", type=int_arg("--context-lens"), nargs="+", default=[1024],
                   help="pre-query context lengths, tokens (default 1024: the first measurement's setting, within one "
                        "15-minute exclusive run; the default preset alternates 1024 and 2048)")
    p.add_argument("--runs", type=run_arg, nargs="+", default=[(1, "sequential"), (EVAL_BATCH, "sequential"),
                                                                (EVAL_BATCH, "packed")],
                   help="runs as EVAL_BATCH[:EXECUTOR] (executor default: sequential); the first is the baseline "
                        f"(default: 1 {EVAL_BATCH} {EVAL_BATCH}:packed)")
    p.add_argument("--threads", type=int_arg("--threads"), default=1, help="torch threads (default 1)")
    p.add_argument("--out", default=None, help="where the sweep folders go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the summary as JSON here")
    return p.parse_args(argv)


def run_arg(text: str) -> tuple[int, str]:
    """``EVAL_BATCH[:EXECUTOR]`` -> ``(eval_batch, executor)``; argparse reports a bad value with the option name."""
    from sur_lab.executors import get_executor

    batch, _, executor = text.partition(":")
    executor = executor or "sequential"
    try:
        value = int(batch)
        get_executor(executor)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--runs: {text!r} is not EVAL_BATCH[:EXECUTOR] ({err})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--runs: eval_batch must be >= 1; got {value}")
    return value, executor


class _AnswerTimer:
    """Wall time of the batched answer's phases (s), summed over batches: a timing subclass of
    :class:`sur_lab.answer.AnswerBatch` installed in :mod:`sur_lab.sweeps.case` for the benchmark only."""

    def __init__(self) -> None:
        from sur_lab.answer import AnswerBatch

        self.totals = {"query": 0.0, "decode": 0.0, "score": 0.0}
        timer = self

        class TimedAnswerBatch(AnswerBatch):
            def __init__(self, *args, **kwargs):
                t0 = time.perf_counter()
                super().__init__(*args, **kwargs)
                timer.totals["query"] += time.perf_counter() - t0

            def decode(self, *args, **kwargs):
                t0 = time.perf_counter()
                out = super().decode(*args, **kwargs)
                timer.totals["decode"] += time.perf_counter() - t0
                return out

            def score(self, *args, **kwargs):
                t0 = time.perf_counter()
                out = super().score(*args, **kwargs)
                timer.totals["score"] += time.perf_counter() - t0
                return out

        self.cls = TimedAnswerBatch

    def reset(self) -> None:
        for k in self.totals:
            self.totals[k] = 0.0


def breakdown(df: pd.DataFrame, answer_s: dict, wall_s: float) -> dict[str, float]:
    """Seconds per case of each phase: prepare (Dirty prefill + Shift), the Replay and Re-prefill rebuilds, the
    budgeted repairs (select + refresh), the answer's query forward, decode and scoring, and the rest of the wall."""
    n = df["case_id"].nunique()
    by_case = df.groupby("case_id")
    ref = df.set_index("method")["refresh_ms"]
    budgeted = df[df["budget_pct"].notna()]
    parts = {
        "prepare": (by_case["dirty_ms"].first().sum() + by_case["shift_ms"].max().sum()) / 1e3,
        "replay": float(ref.get("Replay", pd.Series(dtype=float)).sum()) / 1e3,
        "reprefill": float(ref.get("Re-prefill", pd.Series(dtype=float)).sum()) / 1e3,
        "budgeted_repairs": (budgeted["select_ms"].sum() + budgeted["refresh_ms"].sum()) / 1e3,
        "query": answer_s["query"], "decode": answer_s["decode"], "score": answer_s["score"],
    }
    parts["other"] = wall_s - sum(parts.values())
    return {f"{k}_s_per_case": v / n for k, v in parts.items()}


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


def _margin_where_answers_part(lm, case, method: str, budget: float, other_text: str, max_new: int,
                               executor: str = "sequential"):
    """Decode ``method``'s cache alone, step by step; return ``(step, margin)`` at the first step whose token makes
    the decoded text stop being a prefix of ``other_text`` (margin: top-1 minus top-2 logit there)."""
    import math

    from sur_lab.forward import decode_step, forward_tokens
    from sur_lab.repair import prepare, repair

    result = repair(lm, prepare(lm, case.edit), method, float("nan") if math.isnan(budget) else budget,
                    executor=executor)
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
    sizes = niah.params(args.preset, num_cases=args.cases, context_lens=args.context_lens)
    lm = load_model(args.model)
    cases = niah.cases(lm.tokenizer, preset=args.preset, num_cases=args.cases, context_lens=args.context_lens)
    methods = niah.methods(sizes)
    budgets = sizes["budgets"]
    kw = dict(max_new_tokens=sizes["max_new_tokens"], scorer=niah.niah_scorer, parser=niah.parse_niah_answer, seed=0,
              progress=False)
    per_case = len(grid_keys(methods, budgets))
    print(f"{lm.spec.name}: {len(cases)} NIAH cases ({args.preset} preset, {sizes['context_lens']} tokens) x "
          f"{per_case} records; {args.threads} torch thread(s); max_new_tokens {sizes['max_new_tokens']}", flush=True)
    import sur_lab.sweeps.case as case_module

    timer = _AnswerTimer()
    plain = case_module.AnswerBatch
    case_module.AnswerBatch = timer.cls  # the benchmark's timing subclass; restored below
    rows, runs, parts = [], {}, []
    try:
        for eb, executor in args.runs:
            label = f"{eb}:{executor}"
            if label in runs:
                raise SystemExit(f"--runs repeats {label}")
            timer.reset()
            reset = _reset_peak()
            t0 = time.perf_counter()
            df = run_sweep(lm, cases, methods, budgets, root / f"eval_batch-{eb}-{executor}", eval_batch=eb,
                           executor=executor, **kw)
            wall = time.perf_counter() - t0
            runs[label] = df
            rows.append({"run": label, "eval_batch": eb, "executor": executor, "records": len(df), "wall_s": wall,
                         "records_per_min": len(df) / wall * 60, "peak_rss_mb": _peak_mb(),
                         "peak_is_this_run": reset})
            parts.append({"run": label, **breakdown(df, dict(timer.totals), wall)})
            print(f"run {label}: {len(df)} records in {wall:.0f} s", flush=True)
    finally:
        case_module.AnswerBatch = plain
    base_label = rows[0]["run"]
    base = runs[base_label]
    summary = pd.DataFrame(rows)
    summary["ratio"] = summary["records_per_min"] / summary["records_per_min"].iloc[0]
    disagreements = []
    agree = {}
    for label, df in runs.items():
        if label == base_label:
            continue
        # pandas matches NaN budgets (the references) with NaN in merge keys.
        merged = base.merge(df, on=["case_id", "method", "budget_pct"], suffixes=("_base", "_run"), how="outer")
        same = merged["answer_base"] == merged["answer_run"]
        agree[label] = float(same.mean())
        for row in merged[~same].itertuples():
            case = next(c for c in cases if c.case_id == row.case_id)
            step, margin = _margin_where_answers_part(lm, case, row.method, row.budget_pct, row.answer_run,
                                                      sizes["max_new_tokens"], executor=args.runs[0][1])
            disagreements.append({"run": label, "case_id": row.case_id, "method": row.method,
                                  "budget_pct": row.budget_pct, "answer_baseline": row.answer_base,
                                  "answer_run": row.answer_run, "parting_step": step,
                                  "top2_logit_margin": margin})
    summary["answer_agreement"] = summary["run"].map(agree)
    table = pd.DataFrame(parts)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print()
        print(summary.round({"wall_s": 1, "records_per_min": 2, "peak_rss_mb": 0, "ratio": 2,
                             "answer_agreement": 4}).to_string(index=False))
        print()
        print("where a case's time goes (s per case; query/decode/score: batch wall times summed over the case):")
        print(table.round(2).to_string(index=False))
        print()
        if disagreements:
            print(pd.DataFrame(disagreements).to_string(index=False))
        else:
            print("no disagreements: every run's answers equal the baseline's")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary.to_dict("records"), "breakdown": parts,
                                               "disagreements": disagreements}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
