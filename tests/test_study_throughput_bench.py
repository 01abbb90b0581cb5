"""The study-throughput benchmark's plumbing (``scripts/bench_study_throughput.py``, issue 37) on hand-made records:
the run syntax, the breakdown, answer agreement and the parity study's decision. No timing is asserted."""

from __future__ import annotations

import argparse
import json
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_study_throughput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_study_throughput_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through the module
    spec.loader.exec_module(module)
    return module


def test_run_syntax(bench):
    assert bench.run_arg("16") == bench.RunSpec(16, "sequential", "float32", False)
    spec = bench.run_arg("16:packed:bfloat16:shared")
    assert spec == bench.RunSpec(16, "packed", "bfloat16", True) and spec.label == "16:packed:bfloat16:shared"
    assert bench.run_arg("8:packed:auto").dtype == "auto"
    assert bench.run_arg("1::float32").executor == "sequential"
    for bad, match in (("0", ">= 1"), ("16:nope", "EXECUTOR"), ("16:packed:int8", "dtype"),
                       ("16:packed:float32:maybe", "SHARING"), ("16:a:b:c:d", "EVAL_BATCH")):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            bench.run_arg(bad)


def _records(em: dict[str, list[int]], answers: dict[str, list[str]] | None = None, n: int = 12) -> pd.DataFrame:
    """n cases over two context lengths; ``em[arm]`` per case ('SUR 5%' is SUR at 5 %, else a reference)."""
    rows = []
    for arm, values in em.items():
        method, _, budget = arm.rpartition(" ") if arm.endswith("%") else (arm, "", "")
        for i in range(n):
            rows.append({"case_id": f"c{i}", "context_len": 1024 if i % 2 else 2048, "method": method,
                         "budget_pct": float(budget.rstrip("%")) if budget else math.nan, "em": bool(values[i]),
                         "answer": (answers or {}).get(arm, [str(v) for v in values])[i]})
    return pd.DataFrame(rows)


BASE = {"Shift": [0] * 12, "Re-prefill": [1] * 12, "SUR 5%": [1] * 9 + [0] * 3, "Dense tokens 5%": [0, 1] * 6}


def test_breakdown_counts_a_shared_reprefill_as_no_work(bench):
    df = _records(BASE).assign(dirty_ms=1000.0, shift_ms=500.0, select_ms=0.0, refresh_ms=2000.0)
    df.loc[df.method == "Re-prefill", "refresh_ms"] = math.nan
    parts = bench.breakdown(df, {"query": 12.0, "decode": 24.0, "score": 6.0}, wall_s=120.0)
    assert parts["prepare_s_per_case"] == pytest.approx(1.5)
    assert parts["reprefill_s_per_case"] == 0.0 and parts["other_refs_s_per_case"] == pytest.approx(2.0)
    assert parts["budgeted_repairs_s_per_case"] == pytest.approx(4.0)
    assert parts["query_s_per_case"] == pytest.approx(1.0)
    assert sum(parts.values()) == pytest.approx(10.0)  # the phases and the rest add up to the wall per case


def test_agreement_and_a_parity_that_holds(bench):
    a = _records(BASE)
    b = _records(BASE, answers={"SUR 5%": ["x"] + [str(v) for v in BASE["SUR 5%"][1:]]})
    overall, per_arm, merged = bench.answer_agreement(a, b)
    assert overall == pytest.approx(1 - 1 / len(a)) and len(merged) == len(a)
    assert per_arm.set_index("arm")["agree"].to_dict()["SUR 5%"] == pytest.approx(11 / 12)
    em = bench.em_parity(a, b, "context_len")
    assert set(em["arm"]) == set(BASE) and (em["delta"] == 0).all()
    changes = bench.verdict_changes(bench.primary_comparisons("niah", a), bench.primary_comparisons("niah", b))
    assert not changes["changed"].any() and len(changes) == 4  # two budgeted arms x two baselines
    flips = bench.ordering_flips(a, b, "context_len")
    holds, reasons = bench.parity_holds(em, changes, flips, agreement=overall)
    assert overall >= bench.MIN_ANSWER_AGREEMENT and holds and reasons == [] and flips.empty
    # Intervals that do not separate are not enough: answers that agree on too few records fail the parity.
    holds, reasons = bench.parity_holds(em, changes, flips, agreement=0.95)
    assert not holds and reasons == ["answers agree on 95.0 % of the records, below the 97 % target"]


def test_a_parity_that_fails_names_what_moved(bench):
    a = _records(BASE)
    moved = dict(BASE, **{"SUR 5%": [0] * 12})  # SUR loses every answer: its EM difference separates
    b = _records(moved)
    em = bench.em_parity(a, b, "context_len", names=("f32", "bf16"))
    row = em.set_index("arm").loc["SUR 5%"]
    assert row["delta"] == pytest.approx(-75.0) and row["unit"] == "pp" and row["verdict"] == "loses to"
    assert row["em_f32"] == 75.0  # 9 discordant cases, all one way: exact sign test p = 2 ** -8
    changes = bench.verdict_changes(bench.primary_comparisons("niah", a), bench.primary_comparisons("niah", b),
                                    names=("f32", "bf16"))
    assert changes["changed"].any()  # SUR vs Shift: beats in f32, not separated in bf16
    flips = bench.ordering_flips(a, b, "context_len", names=("f32", "bf16"))
    assert {(r.x, r.y) for r in flips.itertuples()} >= {("SUR 5%", "Dense tokens 5%")}
    holds, reasons = bench.parity_holds(em, changes, flips)
    assert not holds and any("EM of SUR 5%" in r for r in reasons) and any("primary" in r for r in reasons)
    assert np.isfinite(bench.shift_damage(a, "context_len")["delta"])
    assert bench.shift_damage(a, "context_len")["delta"] == pytest.approx(100.0)


def test_parity_needs_two_different_runs_and_one_run_measures_alone(bench, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit, match="compares a run with itself"):
        bench.main(["--runs", "16", "16:packed", "--parity", "1", "1", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # refused before any run started

    # One run: its child's result is summarised and no parity is attempted (the child process is stood in for).
    def child(cmd, check):
        result = Path(cmd[cmd.index("--child-result") + 1])
        result.write_text(json.dumps({
            "run": "16:packed", "eval_batch": 16, "executor": "packed", "dtype": "float32", "dtype_reason": "requested",
            "sharing": "independent", "records": 48, "cases": 12, "wall_s": 60.0, "records_per_min": 48.0,
            "model_rss_mb": 1.0, "peak_rss_mb": 2.0, "peak_is_this_run": True, "folder": str(tmp_path),
            "breakdown": {"prepare_s_per_case": 1.0}}))

    monkeypatch.setattr(bench.subprocess, "run", child)
    monkeypatch.setattr(bench, "_load", lambda study, folder: _records(BASE))
    out = tmp_path / "one.json"
    assert bench.main(["--runs", "16:packed", "--out", str(tmp_path), "--json", str(out)]) == 0
    assert "one run: no parity study" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["summary"][0]["records_per_min"] == 48.0 and "parity_holds" not in saved
