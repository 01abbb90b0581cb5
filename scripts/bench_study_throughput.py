#!/usr/bin/env python
"""Study throughput and bfloat16 parity: a study's default sweep run several ways, side by side, each run in its own
process (issues 23 and 37), with where a case's time goes, peak memory and the answers' agreement.

Builds ``--cases`` cases of a study's preset (``--study niah``: Erasing-NIAH, ``sur_lab.studies.niah``, cases
alternating over the preset's context lengths; ``--study stale-facts``: ``sur_lab.studies.stale_facts``) with roster
seed ``--seed`` on the Qwen study model, and runs the study's own ``sweep()`` (its references, allocators, budgets,
scorer and decoding) into a fresh folder once per ``--runs`` entry ``EVAL_BATCH[:EXECUTOR[:DTYPE[:SHARING]]]``:

- ``EXECUTOR``: the budgeted refreshes' executor (default ``sequential``; ``packed``: one traversal, the one-pass C++
  kernel on a CPU);
- ``DTYPE``: the model's parameter dtype (default ``float32``; ``bfloat16``, or ``auto``: what ``load_model`` picks);
- ``SHARING``: ``independent`` (default: Re-prefill rebuilt from empty, Replay computed per record, as before issue 37)
  or ``shared`` (exact prefix sharing inside a case, :attr:`sur_lab.repair.PreparedEdit.share_prefix`).

The first run is the baseline. Every run is a child process (``--child``) that loads its model (not timed), runs the
sweep and reports, so each run's peak resident memory (``VmHWM``) is its own: model, caches and answers. Printed:

- records per minute (records / wall time of the sweep: preparation, repairs, answers, the store) and the ratio to the
  baseline; peak resident memory and its ratio to the baseline's;
- where a case's time goes, seconds per case: the Dirty prefill and its Shift (``prepare``), the Replay and Re-prefill
  references (from the records' own timings: a shared Re-prefill ran no rebuild and counts 0), the budgeted repairs
  (selection + refresh), the answer's query forward, greedy decode and teacher-forced scoring (batch wall times,
  measured around :class:`sur_lab.answer.AnswerBatch`), and the rest (stacking, endpoints, the store);
- for every other run, the fraction of records whose answers equal the baseline's, overall and per method, and (with
  ``--margins``) each disagreement with the top-2 logit margin of the baseline's answer where the answers part;
- the parity study of ``--parity A B`` (default: the baseline against the last run), for a dtype change: every
  method's EM in both runs with the case-paired difference and its interval, Shift's damage (Re-prefill EM minus
  Shift EM) in both, the study's primary comparisons (NIAH: each budgeted method against Shift and Re-prefill; stale
  facts: the compared arms against each other and the baselines, EM and stale rate) with their verdict in each run,
  and the methods' ordering (pairs of arms whose EM order flips between the runs, with their intervals). Parity holds
  when every EM difference's interval contains 0, no primary verdict changes and no flipped pair separates in either
  run; bfloat16 is the CPU default only when it does (``sur_lab.models.AUTO_CPU_BFLOAT16``, ``docs/bf16.md``).

Intervals and verdicts: :func:`sur_lab.analysis.decisions.paired_family` (issue 36). A run-vs-run EM difference is
one comparison decided alone (exact sign test on the discordant cases, Newcombe's paired interval); the primary
comparisons are the study's own declared families (``paired_differences``), Holm within each.

    flock -x /work/cpu.lock .venv/bin/python scripts/bench_study_throughput.py --study niah --cases 8 --seed 3701 \
        --runs 16:packed:float32 16:packed:bfloat16:shared
    .venv/bin/python scripts/bench_study_throughput.py --cases 2 --runs 1 16 16:packed   # which batch size

Run it under an exclusive CPU lock: the ratios are only meaningful when nothing else shares the cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

#: Studies the benchmark runs: the study module, the column its cases are stratified by (the bootstrap resamples cases
#: within it), and the record columns whose paired differences are its primary comparisons.
STUDIES = {"niah": ("niah", "context_len", ("em",)), "stale-facts": ("stale_facts", "family", ("em", "stale"))}
SHARING = ("independent", "shared")
N_BOOT = 10_000
BOOT_SEED = 20260928


@dataclass(frozen=True)
class RunSpec:
    """One run: ``EVAL_BATCH[:EXECUTOR[:DTYPE[:SHARING]]]``."""

    eval_batch: int
    executor: str = "sequential"
    dtype: str = "float32"
    shared: bool = False

    @property
    def label(self) -> str:
        return f"{self.eval_batch}:{self.executor}:{self.dtype}:{SHARING[int(self.shared)]}"


def run_arg(text: str) -> RunSpec:
    """``EVAL_BATCH[:EXECUTOR[:DTYPE[:SHARING]]]`` -> :class:`RunSpec`; argparse reports a bad value with the option
    name."""
    from sur_lab.executors import get_executor
    from sur_lab.models import check_dtype_arg

    parts = text.split(":")
    if not 1 <= len(parts) <= 4:
        raise argparse.ArgumentTypeError(f"--runs: {text!r} is not EVAL_BATCH[:EXECUTOR[:DTYPE[:SHARING]]]")
    batch, executor, dtype, sharing = (parts + ["", "", ""])[:4]
    executor, dtype, sharing = executor or "sequential", dtype or "float32", sharing or "independent"
    try:
        value = int(batch)
        get_executor(executor)
        check_dtype_arg(dtype)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--runs: {text!r} is not EVAL_BATCH[:EXECUTOR[:DTYPE[:SHARING]]] ({err})") \
            from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--runs: eval_batch must be >= 1; got {value}")
    if sharing not in SHARING:
        raise argparse.ArgumentTypeError(f"--runs: SHARING of {text!r} must be one of {', '.join(SHARING)}")
    return RunSpec(value, executor, dtype, sharing == "shared")


def parse_args(argv=None) -> argparse.Namespace:
    from sur_lab.runtime.params import int_arg
    from sur_lab.sweeps import EVAL_BATCH

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--study", choices=list(STUDIES), default="niah", help="the study whose sweep runs (default niah)")
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="model (default: the Qwen study model)")
    p.add_argument("--preset", default="default", help="preset whose sizes the cases take (default: default)")
    p.add_argument("--cases", type=int_arg("--cases"), default=4, help="cases (default 4)")
    p.add_argument("--seed", type=int_arg("--seed", 0), default=0,
                   help="roster and allocator seed (default 0, the studies' design roster; use another for parity)")
    p.add_argument("--context-lens", type=int_arg("--context-lens"), nargs="+", default=None,
                   help="pre-query context lengths, tokens (default: the preset's)")
    p.add_argument("--runs", type=run_arg, nargs="+",
                   default=[RunSpec(1), RunSpec(EVAL_BATCH), RunSpec(EVAL_BATCH, "packed")],
                   help="runs as EVAL_BATCH[:EXECUTOR[:DTYPE[:SHARING]]] (defaults sequential, float32, independent); "
                        f"the first is the baseline (default: 1 {EVAL_BATCH} {EVAL_BATCH}:packed)")
    p.add_argument("--parity", nargs=2, type=int, default=None, metavar=("A", "B"),
                   help="indices (0-based) into --runs of the two runs the parity study compares (default: 0 and the "
                        "last run)")
    p.add_argument("--threads", type=int_arg("--threads"), default=1, help="torch threads (default 1)")
    p.add_argument("--margins", action="store_true",
                   help="for each answer that differs from the baseline's, the baseline's top-2 logit margin where the "
                        "answers part (one more decode per disagreement, untimed)")
    p.add_argument("--out", default=None, help="where the sweep folders go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the summary as JSON here")
    p.add_argument("--child", type=run_arg, default=None, help=argparse.SUPPRESS)  # one run, in its own process
    p.add_argument("--child-result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------- one run (child)


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


def breakdown(df: pd.DataFrame, answer_s: dict, wall_s: float) -> dict[str, float]:
    """Seconds per case of each phase: prepare (Dirty prefill + Shift), the Replay and Re-prefill references, the
    budgeted repairs (select + refresh), the answer's query forward, decode and scoring, and the rest of the wall. A
    shared Re-prefill (refresh time NaN: no rebuild ran) counts 0."""
    n = df["case_id"].nunique()
    by_case = df.groupby("case_id")
    budgeted = df[df["budget_pct"].notna()]
    ref = df[df["budget_pct"].isna()].set_index("method")["refresh_ms"]
    parts = {
        "prepare": (by_case["dirty_ms"].first().sum() + by_case["shift_ms"].max().sum()) / 1e3,
        "replay": float(np.nansum(ref.get("Replay", pd.Series(dtype=float)))) / 1e3,
        "reprefill": float(np.nansum(ref.get("Re-prefill", pd.Series(dtype=float)))) / 1e3,
        "other_refs": float(np.nansum(ref.drop(["Replay", "Re-prefill"], errors="ignore"))) / 1e3,
        "budgeted_repairs": float(np.nansum(budgeted["select_ms"]) + np.nansum(budgeted["refresh_ms"])) / 1e3,
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


def _rss_mb(field: str = "VmHWM") -> float:
    """This process's resident memory, MB: the peak (``VmHWM``) or the current (``VmRSS``); ru_maxrss where /proc is
    missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _study(name: str):
    import importlib

    return importlib.import_module(f"sur_lab.studies.{STUDIES[name][0]}")


def _overrides(args) -> dict:
    out = {"num_cases": args.cases}
    if args.context_lens:
        out["context_lens"] = args.context_lens
    return out


def run_child(args) -> int:
    """One run in this process: load the model (untimed), run the study's sweep (timed), write the result JSON."""
    import sur_lab.sweeps.case as case_module
    from sur_lab.fingerprint import dtype_reason
    from sur_lab.models import load_model

    spec: RunSpec = args.child
    torch.set_num_threads(args.threads)
    study = _study(args.study).STUDY
    lm = load_model(args.model, dtype=spec.dtype)
    study.cases(lm.tokenizer, study.params(args.preset, **_overrides(args)), args.seed)  # warm the corpus, untimed
    timer = _AnswerTimer()
    case_module.AnswerBatch = timer.cls  # this process runs nothing else
    loaded_mb = _rss_mb("VmRSS")
    reset = _reset_peak()
    t0 = time.perf_counter()
    records, folder, _ = study.sweep(lm, preset=args.preset, out=args.out, seed=args.seed, executor=spec.executor,
                                     eval_batch=spec.eval_batch, progress=False, share_prefix=spec.shared,
                                     **_overrides(args))
    wall = time.perf_counter() - t0
    result = {"run": spec.label, "eval_batch": spec.eval_batch, "executor": spec.executor,
              "dtype": str(lm.dtype).removeprefix("torch."), "dtype_reason": dtype_reason(lm),
              "sharing": SHARING[int(spec.shared)], "records": len(records), "cases": int(records["case_id"].nunique()),
              "wall_s": wall, "records_per_min": len(records) / wall * 60, "model_rss_mb": loaded_mb,
              "peak_rss_mb": _rss_mb("VmHWM"), "peak_is_this_run": reset, "folder": str(folder),
              "breakdown": breakdown(records, dict(timer.totals), wall)}
    Path(args.child_result).write_text(json.dumps(result, indent=1))
    return 0


# -------------------------------------------------------------------------------------------- comparisons (parent)


def _with_arm(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with an ``arm`` column: ``"SUR 5%"`` for a budgeted method, the method itself for a reference
    (:func:`sur_lab.analysis.conclusions.arm_labels`)."""
    from sur_lab.analysis.conclusions import arm_labels

    return df.assign(arm=arm_labels(df).to_numpy())


def answer_agreement(base: pd.DataFrame, run: pd.DataFrame) -> tuple[float, pd.DataFrame, pd.DataFrame]:
    """Fraction of records whose answers equal the baseline's, the same per arm (``arm``, ``n``, ``agree``), and the
    merged frame (``answer_base``, ``answer_run``, ``same``)."""
    keys = ["case_id", "method", "budget_pct"]
    # pandas matches NaN budgets (the references) with NaN in merge keys.
    merged = base[keys + ["answer"]].merge(run[keys + ["answer"]], on=keys, suffixes=("_base", "_run"), how="outer")
    merged["same"] = merged["answer_base"] == merged["answer_run"]
    per_arm = _with_arm(merged).groupby("arm", sort=False).agg(n=("same", "size"), agree=("same", "mean"))
    return float(merged["same"].mean()), per_arm.reset_index(), merged


def _paired(df: pd.DataFrame, a: str, b: str, metric: str, strata: str, label_col: str) -> dict:
    """Case-paired difference of mean ``metric`` of ``a`` minus ``b`` (values of ``label_col``), decided alone
    by :func:`sur_lab.analysis.decisions.paired_family` (exact sign test on the discordant cases, Newcombe's paired
    interval; issue 36); rows whose metric is NaN are left out on both sides. ``strata`` names the records' stratum
    column (kept in the rows' layout; the exact test pairs cases and needs no strata). Returns ``delta``,
    ``delta_low``, ``delta_high``, ``unit`` (:func:`sur_lab.analysis.decisions.in_units`: "pp" for a 0/1 metric),
    ``n`` (cases) and ``verdict``."""
    from sur_lab.analysis.decisions import NA, in_units, paired_family

    sub = df[df[label_col].isin([a, b])].dropna(subset=[metric])
    wide = sub.pivot_table(index="case_id", columns=label_col, values=metric, aggfunc="mean")
    if a not in wide.columns or b not in wide.columns or wide[[a, b]].dropna().empty:
        return {"delta": float("nan"), "delta_low": float("nan"), "delta_high": float("nan"), "unit": "", "n": 0,
                "verdict": NA}
    wide = wide[[a, b]].dropna()
    kind = "binary" if set(np.unique(wide.to_numpy())) <= {0.0, 1.0} else "continuous"
    res = in_units(paired_family({(a, b): (wide[a].to_numpy(), wide[b].to_numpy())}, kind=kind, adjust="none",
                                 n_boot=N_BOOT, seed=BOOT_SEED)).iloc[0]
    return {"delta": res["delta"], "delta_low": res["delta_low"], "delta_high": res["delta_high"],
            "unit": res["unit"], "n": int(res["n"]), "verdict": res["verdict"]}


def em_parity(base: pd.DataFrame, run: pd.DataFrame, strata: str, names=("A", "B")) -> pd.DataFrame:
    """Per arm: EM (%) in both runs, answer agreement, and the case-paired EM difference (B minus A, ``delta`` in
    ``unit`` pp) with its interval and verdict."""
    a, b = names
    both = pd.concat([_with_arm(base).assign(run=a), _with_arm(run).assign(run=b)], ignore_index=True)
    agree = answer_agreement(base, run)[1].set_index("arm")["agree"]
    rows = []
    for arm, g in both.groupby("arm", sort=False):
        row = {"arm": arm, f"em_{a}": 100 * g.loc[g.run == a, "em"].astype(float).mean(),
               f"em_{b}": 100 * g.loc[g.run == b, "em"].astype(float).mean(), "answers_agree": agree.get(arm)}
        row.update(_paired(g, b, a, "em", strata, "run"))
        rows.append(row)
    return pd.DataFrame(rows)


def shift_damage(records: pd.DataFrame, strata: str) -> dict:
    """Re-prefill EM minus Shift EM, case-paired, with its interval (:func:`_paired`'s keys)."""
    return _paired(records, "Re-prefill", "Shift", "em", strata, "method")


def primary_comparisons(study: str, records: pd.DataFrame) -> pd.DataFrame:
    """The study's primary comparisons with the study's own function: rows ``metric``, ``a``, ``b``, ``budget_pct``,
    ``delta``, ``delta_low``, ``delta_high``, ``unit``, ``n``, ``verdict``."""
    mod = _study(study)
    if study == "niah":
        out = mod.paired_differences(records, metric="em", n_boot=N_BOOT, seed=BOOT_SEED)
        out = out.drop(columns=["a", "b"]).rename(columns={"method": "a", "baseline": "b"}).assign(metric="em")
    else:
        out = mod.paired_differences(records, n_boot=N_BOOT, seed=BOOT_SEED)  # its metrics: em and stale
    return out[["metric", "a", "b", "budget_pct", "delta", "delta_low", "delta_high", "unit", "n", "verdict"]]


def verdict_changes(primary_a: pd.DataFrame, primary_b: pd.DataFrame, names=("A", "B")) -> pd.DataFrame:
    """The primary comparisons side by side (``delta_A``, ``verdict_A``, ``delta_B``, ``verdict_B``, ...,
    ``changed``)."""
    a, b = names
    keys = ["metric", "a", "b", "budget_pct"]
    cols = ["delta", "delta_low", "delta_high", "verdict"]
    merged = primary_a[keys + cols].merge(primary_b[keys + cols], on=keys, suffixes=(f"_{a}", f"_{b}"), how="outer")
    merged["changed"] = merged[f"verdict_{a}"] != merged[f"verdict_{b}"]
    return merged


def ordering_flips(base: pd.DataFrame, run: pd.DataFrame, strata: str, names=("A", "B")) -> pd.DataFrame:
    """Pairs of arms whose EM order differs between the runs (strictly ordered one way in one run, tied or the other
    way in the other), with each run's case-paired difference and verdict; ``separated`` when either run separates
    the pair (the ordering then disagrees beyond the intervals)."""
    a, b = names
    ea = _with_arm(base).groupby("arm", sort=False)["em"].apply(lambda s: s.astype(float).mean())
    eb = _with_arm(run).groupby("arm", sort=False)["em"].apply(lambda s: s.astype(float).mean())
    rows = []
    for x, y in itertools.combinations([arm for arm in ea.index if arm in eb.index], 2):
        if np.sign(ea[x] - ea[y]) == np.sign(eb[x] - eb[y]):
            continue
        pa = _paired(_with_arm(base), x, y, "em", strata, "arm")
        pb = _paired(_with_arm(run), x, y, "em", strata, "arm")
        rows.append({"x": x, "y": y, f"delta_{a}": pa["delta"], f"ci_{a}": (pa["delta_low"], pa["delta_high"]),
                     f"verdict_{a}": pa["verdict"], f"delta_{b}": pb["delta"],
                     f"ci_{b}": (pb["delta_low"], pb["delta_high"]), f"verdict_{b}": pb["verdict"]})
    out = pd.DataFrame(rows, columns=["x", "y", f"delta_{a}", f"ci_{a}", f"verdict_{a}", f"delta_{b}", f"ci_{b}",
                                      f"verdict_{b}"])
    from sur_lab.analysis.decisions import SEPARATED

    out["separated"] = out[f"verdict_{a}"].isin(SEPARATED) | out[f"verdict_{b}"].isin(SEPARATED)
    return out


#: Issue 37's answer-agreement target between the two runs, fixed before any parity run. Intervals that are not
#: separated at a few cases are no evidence that the dtypes agree ("no loss" from a small sample), so the agreement of
#: the answers themselves is a condition too.
MIN_ANSWER_AGREEMENT = 0.97


def parity_holds(em: pd.DataFrame, changes: pd.DataFrame, flips: pd.DataFrame,
                 agreement: float | None = None) -> tuple[bool, list[str]]:
    """The parity condition of issue 37 and the reasons it fails: every arm's EM difference interval contains 0, no
    primary-comparison verdict changed, no flipped pair of arms separates in either run, and (when ``agreement`` is
    given: the fraction of records whose answers are equal in both runs, :func:`answer_agreement`) the answers agree
    on at least :data:`MIN_ANSWER_AGREEMENT` of the records."""
    from sur_lab.analysis.decisions import SEPARATED

    reasons = [f"EM of {r.arm} differs: {r.delta:+.1f} {r.unit} [{r.delta_low:+.1f}, {r.delta_high:+.1f}]"
               for r in em.itertuples() if r.verdict in SEPARATED]
    if agreement is not None and not agreement >= MIN_ANSWER_AGREEMENT:
        reasons.append(f"answers agree on {100 * agreement:.1f} % of the records, below the "
                       f"{100 * MIN_ANSWER_AGREEMENT:g} % target")
    verdict_cols = [c for c in changes.columns if c.startswith("verdict_")]
    reasons += [f"primary {r['metric']} {r['a']} vs {r['b']} at {r['budget_pct']}: {r[verdict_cols[0]]} -> "
                f"{r[verdict_cols[1]]}" for _, r in changes[changes["changed"]].iterrows()]
    reasons += [f"ordering of {r.x} and {r.y} flips beyond the intervals" for r in flips[flips["separated"]].itertuples()]
    return not reasons, reasons


# ------------------------------------------------------------------------------------------------------- margins


def _margin_where_answers_part(lm, case, method: str, budget: float, other_text: str, max_new: int,
                               executor: str = "sequential", options=None):
    """Decode ``method``'s cache alone, step by step; return ``(step, margin)`` at the first step whose token makes
    the decoded text stop being a prefix of ``other_text`` (margin: top-1 minus top-2 logit there)."""
    from sur_lab.forward import decode_step, forward_tokens
    from sur_lab.repair import repair

    result = repair(lm, case.prepare(lm), method, float("nan") if math.isnan(budget) else budget,
                    executor=executor, options=options)
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


# ---------------------------------------------------------------------------------------------------------- main


def _load(study: str, folder: str) -> pd.DataFrame:
    df = pd.read_parquet(Path(folder) / "records.parquet")
    return _study(study).add_stale_endpoints(df) if study == "stale-facts" else df


#: pandas display options of the printed tables.
DISPLAY = ("display.width", 250, "display.max_columns", 40, "display.max_rows", 500, "display.max_colwidth", 60)


def _print_runs(summary: pd.DataFrame, results: list[dict], table: pd.DataFrame) -> None:
    """Print each run's throughput summary, its dtype and why, and where a case's time goes."""
    print()
    print(summary.round({"wall_s": 1, "records_per_min": 2, "model_rss_mb": 0, "peak_rss_mb": 0, "ratio": 2,
                         "peak_ratio": 2, "answer_agreement": 4}).to_string(index=False))
    print()
    for r in results:
        print(f"{r['run']}: dtype {r['dtype']} ({r['dtype_reason']})")
    print()
    print("where a case's time goes (s per case; query/decode/score: batch wall times summed over the case):")
    print(table.round(2).to_string(index=False))
    print()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return run_child(args)
    labels = [r.label for r in args.runs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"--runs repeats a run: {labels}")
    pa, pb = args.parity if args.parity else (0, len(args.runs) - 1)
    if not (0 <= pa < len(args.runs) and 0 <= pb < len(args.runs)):
        raise SystemExit(f"--parity indices must lie in [0, {len(args.runs) - 1}]")
    if pa == pb and len(args.runs) > 1:
        raise SystemExit(f"--parity {pa} {pb} compares a run with itself: give two different indices")
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_study_throughput_"))
    root.mkdir(parents=True, exist_ok=True)
    _, strata, _ = STUDIES[args.study]
    print(f"{args.study}: {args.cases} cases ({args.preset} preset, seed {args.seed}"
          f"{', context lengths ' + str(args.context_lens) if args.context_lens else ''}); {args.threads} torch "
          f"thread(s); runs {', '.join(labels)}; each run in its own process", flush=True)
    results, records = [], {}
    common = ["--study", args.study, "--model", args.model, "--preset", args.preset, "--cases", str(args.cases),
              "--seed", str(args.seed), "--threads", str(args.threads)]
    if args.context_lens:
        common += ["--context-lens", *map(str, args.context_lens)]
    for i, spec in enumerate(args.runs):
        folder = root / f"run{i}-{spec.label.replace(':', '-')}"
        result_file = root / f"run{i}.json"
        cmd = [sys.executable, os.path.abspath(__file__), *common, "--child", spec.label, "--out", str(folder),
               "--child-result", str(result_file)]
        subprocess.run(cmd, check=True)
        result = json.loads(result_file.read_text())
        results.append(result)
        records[spec.label] = _load(args.study, result["folder"])
        print(f"run {spec.label} ({result['dtype']}: {result['dtype_reason']}): {result['records']} records in "
              f"{result['wall_s']:.0f} s", flush=True)

    base_label = labels[0]
    base = records[base_label]
    summary = pd.DataFrame([{k: v for k, v in r.items() if k not in ("breakdown", "folder", "dtype_reason")}
                            for r in results])
    summary["ratio"] = summary["records_per_min"] / summary["records_per_min"].iloc[0]
    summary["peak_ratio"] = summary["peak_rss_mb"] / summary["peak_rss_mb"].iloc[0]
    agree_rows, per_method, disagreements = {}, [], []
    for label in labels[1:]:
        overall, per_arm, merged = answer_agreement(base, records[label])
        agree_rows[label] = overall
        per_method.append(per_arm.set_index("arm")["agree"].rename(label))
        for row in merged[~merged["same"]].itertuples():
            disagreements.append({"run": label, "case_id": row.case_id, "method": row.method,
                                  "budget_pct": row.budget_pct, "answer_baseline": row.answer_base,
                                  "answer_run": row.answer_run})
    summary["answer_agreement"] = summary["run"].map(agree_rows)
    table = pd.DataFrame([{"run": r["run"], **r["breakdown"]} for r in results])
    if len(labels) == 1:
        # One run measures its throughput alone (e.g. each dtype run on its own core into one --out); a later
        # invocation with both runs resumes their sweeps and compares them.
        with pd.option_context(*DISPLAY):
            _print_runs(summary, results, table)
            print("one run: no parity study (give two --runs to compare them)")
        if args.json:
            Path(args.json).write_text(json.dumps({"summary": summary.to_dict("records"),
                                                   "breakdown": table.to_dict("records")}, indent=1, default=str))
        return 0

    # Parity: run A against run B (the dtypes' EM, Shift's damage, the primary comparisons, the ordering).
    la, lb = labels[pa], labels[pb]
    names = (f"run{pa}", f"run{pb}")
    ra, rb = records[la], records[lb]
    em = em_parity(ra, rb, strata, names)
    damage = pd.DataFrame([{"run": lab, "em_reprefill": 100 * r.loc[r.method == "Re-prefill", "em"].astype(float).mean(),
                            "em_shift": 100 * r.loc[r.method == "Shift", "em"].astype(float).mean(),
                            **shift_damage(r, strata)} for lab, r in ((la, ra), (lb, rb))])
    changes = verdict_changes(primary_comparisons(args.study, ra), primary_comparisons(args.study, rb), names)
    flips = ordering_flips(ra, rb, strata, names)
    holds, reasons = parity_holds(em, changes, flips, agreement=answer_agreement(ra, rb)[0])

    if args.margins and disagreements:
        from sur_lab.models import load_model

        study = _study(args.study).STUDY
        spec = args.runs[0]
        lm = load_model(args.model, dtype=spec.dtype)
        sizes = study.params(args.preset, **_overrides(args))
        cases = {c.case_id: c for c in study.sweep_cases(study.cases(lm.tokenizer, sizes, args.seed), sizes)}
        options = study.options(sizes)
        torch.set_num_threads(args.threads)
        for d in disagreements:
            step, margin = _margin_where_answers_part(lm, cases[d["case_id"]], d["method"], d["budget_pct"],
                                                      d["answer_run"], sizes["max_new_tokens"], spec.executor,
                                                      options)
            d.update(parting_step=step, top2_logit_margin=margin)

    with pd.option_context(*DISPLAY):
        _print_runs(summary, results, table)
        if per_method:
            print(f"answer agreement with the baseline ({base_label}), per method and budget:")
            print(pd.concat(per_method, axis=1).round(4).to_string())
            print()
        print(f"parity: {names[0]} = {la}, {names[1]} = {lb}; EM (%) per arm, {names[1]} minus {names[0]} (pp) with "
              "its case-paired 95 % interval:")
        print(em.round(2).to_string(index=False))
        print()
        print("Shift's damage (Re-prefill EM minus Shift EM, pp) in each run:")
        print(damage.round(2).to_string(index=False))
        print()
        print(f"primary comparisons ({args.study}), each run's difference (pp) and verdict:")
        print(changes.round(1).to_string(index=False))
        print()
        if flips.empty:
            print("ordering: no pair of arms changes its EM order between the runs")
        else:
            print("ordering: pairs of arms whose EM order differs between the runs:")
            print(flips.round(1).to_string(index=False))
        print()
        print(f"parity {'HOLDS' if holds else 'does NOT hold'}" + ("" if holds else ": " + "; ".join(reasons)))
        print()
        if disagreements:
            print(pd.DataFrame(disagreements).to_string(index=False))
        else:
            print("no disagreements: every run's answers equal the baseline's")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "summary": summary.to_dict("records"), "breakdown": table.to_dict("records"),
            "per_method_agreement": {s.name: s.to_dict() for s in per_method}, "em_parity": em.to_dict("records"),
            "shift_damage": damage.to_dict("records"), "primary": changes.to_dict("records"),
            "ordering_flips": flips.to_dict("records"), "parity_holds": holds, "parity_reasons": reasons,
            "disagreements": disagreements}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
