"""The six sweepable studies' ``report()`` and the base's ``conclusion()`` on real records (issue 39): each study's
``STUDY.sweep`` at a tiny size on a tiny random float64 Llama (two layers, sized to the Qwen2.5 tokenizer, whose chat
template the studies render), then ``STUDY.report(records, params)`` and ``STUDY.conclusion(...)``: the declared tables
with their columns, verdicts in the decision layer's words, rows matching cases x arms x budgets, the primary comparison
named in the conclusion, a smoke run's verdicts "not decided", and numbers recomputed from the records with pandas
(on the swept records and on records with planted answers, so that the recomputed difference is not 0)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from conftest import make_tiny_model
from sur_lab.analysis.decisions import COLUMNS, DIFF_COLUMNS, NA, NOT_DECIDED, VERDICTS
from sur_lab.studies import get_study
from sur_lab.studies.base import Report
from sur_lab.studies.presets import smoke_banner
from test_sync import qwen_tokenizer


@pytest.fixture(scope="module")
def lm(data_dir):
    """A two-layer float64 Llama sized to the Qwen2.5 tokenizer (the QA studies need the shared data). Two layers, not
    one: a one-layer model's keys and values depend on the token and its position only, so Shift would be exact and
    every repair difference 0."""
    tok = qwen_tokenizer()
    tiny = make_tiny_model("llama", vocab_size=len(tok), layers=2, hidden=16, heads=2, kv_heads=1, head_dim=8)
    return dataclasses.replace(tiny, tokenizer=tok)


def _swept(lm, name, tmp_path, **overrides):
    """``(study, records, params, report)`` of ``name``'s smoke sweep with ``overrides`` (a fresh folder)."""
    study = get_study(name)
    records, where, _ = study.sweep(lm, preset="smoke", out=tmp_path / name, progress=False, **overrides)
    p = study.params("smoke", **overrides)
    report = study.report(records, p)
    assert isinstance(report, Report) and report.conclusion and all(isinstance(x, str) for x in report.conclusion)
    return study, records, p, report


def _check_decided(table, words=VERDICTS):
    """Every row of a decided-families table carries the decision layer's columns and one of its words."""
    assert len(table) and set(COLUMNS) <= set(table.columns)
    assert set(table["verdict"]) <= set(words), set(table["verdict"]) - set(words)


def _check_conclusion(study, records, p, primary: str, table: str | None, *, undecided=(NOT_DECIDED, NA)) -> str:
    """The base's conclusion at the smoke preset: the banner, the power line, then the report's lines, decided as
    the notebook decides a smoke run (``decides("smoke")`` is False: every verdict of the report's ``table`` is
    ``undecided``, none "not separated"), the primary comparison named. Returns the report's lines joined."""
    lines = study.conclusion(records, p, preset="smoke")
    assert lines[0] == smoke_banner("smoke") and lines[1] == study.power_line(p)
    smoke = study.report(records, p, decide=False)
    assert lines[2:] == smoke.conclusion
    if table is not None:
        assert set(smoke.tables[table]["verdict"]) <= set(undecided), set(smoke.tables[table]["verdict"])
    text = "\n".join(lines[2:])
    assert primary in text, (primary, text)
    assert NOT_DECIDED in text and "not separated" not in text
    return text


def _paired(records, a, b, column, key="case_id"):
    """Mean over ``key`` of ``a``'s minus ``b``'s ``column`` (pandas, rows selected by ``label``)."""
    wide = records.pivot_table(index=key, columns="label", values=column, aggfunc="mean")
    return float((wide[a].astype(float) - wide[b].astype(float)).mean())


def _labelled(records):
    """``label``: ``"SUR 5%"`` for a budgeted row, the method for a reference (NaN budget)."""
    budget = records["budget_pct"]
    return records.assign(label=np.where(budget.isna(), records["method"],
                                         records["method"] + " " + budget.map(lambda b: f"{b:g}%")))


def test_niah_report_and_conclusion(lm, tmp_path):
    kw = dict(allocators=["SUR"], ablation=[], budgets=[5], max_new_tokens=2, num_cases=2)
    study, records, p, report = _swept(lm, "niah", tmp_path, **kw)
    assert len(records) == 2 * (len(p["references"]) + 1 * 1)  # cases x (references + allocators x budgets)
    assert set(report.tables) == {"budget", "decided"}
    budget = report.tables["budget"]
    assert list(budget.columns) == ["Reference", "5%"] and list(budget.index) == [*p["references"], "SUR"]
    lead = "em" if records.loc[records.method == "Re-prefill", "em"].mean() >= 0.5 else "agree_reprefill"
    by_method = records.groupby("method")[lead].mean() * 100
    assert budget.loc["SUR", "5%"] == pytest.approx(by_method["SUR"])
    for ref in p["references"]:
        assert budget.loc[ref, "Reference"] == pytest.approx(by_method[ref])
    decided = report.tables["decided"]
    _check_decided(decided)
    primary = decided[decided.family == study.primary.name].iloc[0]
    assert (primary.a, primary.b, primary.n) == ("SUR 5%", "Shift", 2)
    _check_conclusion(study, records, p, "SUR 5% vs Shift", "decided")

    # Planted answers: Re-prefill right everywhere (EM leads), SUR right on both cases, Shift on the first only.
    cases = sorted(records.case_id.unique())
    planted = records.assign(em=records.method.isin(["Re-prefill", "SUR"])
                             | ((records.method == "Shift") & (records.case_id == cases[0])))
    again = study.report(planted, p)
    row = again.tables["decided"].query("family == @study.primary.name").iloc[0]
    expected = _paired(_labelled(planted), "SUR 5%", "Shift", "em")
    assert expected == 0.5 and row.delta == pytest.approx(100 * expected) and row.n_discordant == 1
    assert again.tables["budget"].loc["Shift", "Reference"] == 50.0


def test_natural_qa_report_and_conclusion(lm, tmp_path):
    study, records, p, report = _swept(lm, "natural-qa", tmp_path, max_new_tokens=2)
    assert set(report.tables) == {"results", "decided"}
    table = report.tables["results"]
    arms = len(p["references"]) + len(p["allocators"]) * len(p["budgets"])
    n_sources = len(p["datasets"]) * p["n_per_dataset"]
    assert len(table) == n_sources * len(p["placements"]) * arms
    assert {"condition", "correct", "dataset", "source_id", "placement"} <= set(table.columns)
    assert set(table.condition) == {*p["references"], "SUR 5%"}
    decided = report.tables["decided"]
    _check_decided(decided)
    primary = decided[decided.family == study.primary.name].iloc[0]
    assert (primary.a, primary.b, primary.n) == ("SUR 5%", "Shift", n_sources)
    _check_conclusion(study, records, p, "SUR 5% vs Shift", "decided")

    # Planted answers: Re-prefill and SUR right everywhere, Shift on the first source only: +50 pp.
    first = sorted(records.source_id.unique())[0]
    planted = records.assign(em=records.method.isin(["Re-prefill", "SUR"])
                             | ((records.method == "Shift") & (records.source_id == first)))
    row = study.report(planted, p).tables["decided"].query("family == @study.primary.name").iloc[0]
    expected = _paired(_labelled(planted), "SUR 5%", "Shift", "em", key="source_id")
    assert expected == 0.5 and row.estimate == pytest.approx(expected) and row.n_discordant == 1


def test_stale_facts_report_and_conclusion(lm, tmp_path):
    kw = dict(allocators=["SUR"], max_new_tokens=2, num_cases=2, families=["value_update", "derived_record"])
    study, records, p, report = _swept(lm, "stale-facts", tmp_path, **kw)
    assert set(report.tables) == {"summary", "paired", "stale_rates", "old_margin", "margins"}
    late = records.method.str.endswith(" (late)")
    assert (~late).sum() == 2 * (len(p["references"]) + 1)  # cases x (references + allocators x budgets)
    assert late.sum() == 2 * 2  # both families replace a value: cases x (Shift, Re-prefill) on their controls
    summary = report.tables["summary"]
    assert {"method", "budget_pct", "n", "em_pct", "stale_pct"} <= set(summary.columns)
    assert len(summary) == len(p["references"]) + 2 + 1  # references, their late controls, SUR at 5 %
    for r in summary.itertuples():
        rows = records[(records.method == r.method) & ((records.budget_pct == r.budget_pct)
                                                       | (records.budget_pct.isna() & pd.isna(r.budget_pct)))]
        assert r.n == len(rows) and r.em_pct == pytest.approx(100 * rows.em.mean())
    paired = report.tables["paired"]
    _check_decided(paired)
    primary = paired[paired.family == study.primary.name].iloc[0]
    assert (primary.a, primary.b, primary.metric) == ("SUR 5%", "Shift", "em")
    _check_conclusion(study, records, p, "SUR 5% vs Shift", "paired")

    # Planted answers: SUR right on both cases, Shift on the first only.
    first = sorted(records.case_id.unique())[0]
    planted = records.assign(em=(records.method == "SUR") | ((records.method == "Shift") & (records.case_id == first)))
    again = study.report(planted, p, n_boot=200)
    row = again.tables["paired"].query("family == @study.primary.name").iloc[0]
    expected = _paired(_labelled(planted[~planted.method.str.endswith(" (late)")]), "SUR 5%", "Shift", "em")
    assert expected == 0.5 and row.delta == pytest.approx(100 * expected)
    assert again.tables["summary"].set_index("method").loc["Shift", "em_pct"] == 50.0


def test_evidence_location_report_and_conclusion(lm, tmp_path):
    study, records, p, report = _swept(lm, "evidence-location", tmp_path, max_new_tokens=2, datasets=["hotpotqa"])
    assert set(report.tables) == {"results", "table15", "table16", "gaps", "findings", "decided"}
    table = report.tables["results"]
    arms = len(p["references"]) + int(p["fixed_slot"]) + len(p["allocators"]) * len(p["budgets"])
    assert len(table) == len(records) == p["sources_per_dataset"] * 4 * arms  # sources x cells x arms
    assert set(table.groupby("source_id").cell.nunique()) == {4}
    t15 = report.tables["table15"]
    assert {"condition", "endpoint", "contrast", "estimate", "ci_low", "ci_high", "p_adj", "n", "n_clusters",
            *DIFF_COLUMNS} <= set(t15.columns)
    assert set(t15.condition) == {"Replay", "Fixed slot"} and len(t15) == 2 * 2 * 3  # conditions x endpoints x contrasts
    findings = report.tables["findings"]
    assert list(findings.columns) == ["finding", "rule", "verdict", "evidence", "reproduced"] and len(findings) == 3
    assert all(v.startswith(VERDICTS) for v in findings.verdict), list(findings.verdict)
    # Replay's NLL side contrast (Eq. 10), recomputed: G = gold NLL of Shift minus Replay's in each cell, the side
    # contrast the mean over tails of downstream minus upstream, averaged over sources.
    side = t15.query("condition == 'Replay' and endpoint == 'NLL' and contrast == 'side'").iloc[0]
    nll = table.pivot_table(index=["source_id", "side", "tail"], columns="condition", values="gold_nll")
    g = (nll["Shift"] - nll["Replay"]).unstack("side")
    expected = float((g["downstream"] - g["upstream"]).groupby("source_id").mean().mean())
    assert side.n == side.n_clusters == p["sources_per_dataset"] and expected != 0.0
    assert side.estimate == pytest.approx(expected, rel=1e-12, abs=1e-15) and side.delta == side.estimate
    # The decided table: the primary's one row, Table 15's numbers, the verdict the "NLL side contrast null" finding
    # words.
    decided = report.tables["decided"]
    _check_decided(decided)
    assert list(decided.family) == [study.primary.name] and list(decided.columns) == [*COLUMNS, *DIFF_COLUMNS]
    row = decided.iloc[0]
    np.testing.assert_array_equal([row.estimate, row.ci_low, row.ci_high, row.n],  # NaN where 1 source: equal
                                  [side.estimate, side.ci_low, side.ci_high, side.n])
    assert row.unit == "nats" and findings.iloc[0].verdict.startswith(row.verdict)
    text = _check_conclusion(study, records, p, "NLL side contrast", "findings",
                             undecided=("not decided at this size",))
    assert text.count("\n") == len(findings) - 1


def test_noprefix_report_and_conclusion(lm, tmp_path):
    study, records, p, report = _swept(lm, "noprefix", tmp_path, max_new_tokens=2, n_sources=[1], timed_sources=1)
    assert set(report.tables) == {"runs", "summary", "ledger", "decided"}
    runs, summary, ledger = report.tables["runs"], report.tables["summary"], report.tables["ledger"]
    assert len(runs) == len(records)
    assert {"workload", "label", "protocol", "n", "n_preserved", "preservation", "ci_low", "ci_high"} <= set(
        summary.columns)
    assert int(summary.n.sum()) == len(runs)
    counted = runs.groupby(["workload", "label", "protocol"]).preserved.agg(["size", "sum"])
    got = summary.set_index(["workload", "label", "protocol"])
    assert (got.loc[counted.index, "n"] == counted["size"]).all()
    assert (got.loc[counted.index, "n_preserved"] == counted["sum"]).all()
    assert list(ledger.columns) == ["experiment", "key_result", "verdict", "criterion"]
    assert set(ledger.verdict) <= {"worked", "did not", "not separated", "not shown", "not run", "not decided"}
    assert "Donor-copy vs actual forwarding (suffix K1, risk)" in set(ledger.experiment)
    # The decided table: the primary (donor minus forward preservation of suffix K1, risk) first, recomputed here.
    decided = report.tables["decided"]
    _check_decided(decided)
    primary = decided.iloc[0]
    assert primary.family == study.primary.name and (primary.a, primary.b) == ("donor", "forward")
    k1 = runs[runs.label == "Suffix K1 · risk"].pivot_table(index="case_id", columns="protocol", values="preserved")
    assert primary.n == len(k1) > 0
    assert primary.delta == pytest.approx(100 * (k1["donor"].astype(float) - k1["forward"].astype(float)).mean())
    _check_conclusion(study, records, p, "Donor-copy vs actual forwarding", "ledger",
                      undecided=(NOT_DECIDED, "not shown", "not run"))


def test_agent_traces_report_and_conclusion(lm, tmp_path):
    kw = dict(budgets=[5], max_new_tokens=2, datasets=["hotpotqa"], executor="sequential")
    study, runs, p, report = _swept(lm, "agent-traces", tmp_path, **kw)
    paths = [path.label for path in study.methods(p)]
    assert len(runs) == p["n_traces"] * p["turns"] * len(paths)  # traces x turns x paths
    assert set(report.tables) == {"summary", "regions", "kinds", "decided"}
    summary = report.tables["summary"]
    assert list(summary.columns) == ["path", "turns", "ttft_ms", "agree_pct", "em_pct", "total_recomputed",
                                     "total_ttft_ms", "cost_ratio", "time_ratio"]
    assert sorted(summary.path) == sorted(paths)
    later = runs[runs.turn > 0].groupby("path")
    got = summary.set_index("path")
    for path in paths:
        assert got.loc[path, "agree_pct"] == pytest.approx(100 * later.get_group(path).agree.mean())
        assert got.loc[path, "total_recomputed"] == runs[runs.path == path].recomputed.sum()
    assert got.loc["re-prefill", "cost_ratio"] == 1.0
    assert got.loc["sync 5%", "cost_ratio"] == pytest.approx(
        runs[runs.path == "sync 5%"].recomputed.sum() / runs[runs.path == "re-prefill"].recomputed.sum())
    decided = report.tables["decided"]
    _check_decided(decided)
    assert decided.iloc[0].family == study.primary.name and decided.iloc[0].unit == "x"
    assert (decided.iloc[0].a, decided.iloc[0].b) == ("sync 5%", "prefix reuse")
    _check_conclusion(study, runs, p, "sync 5% vs prefix reuse", "decided")

    # Planted agreement: sync 5% loses re-prefill's answer on the last turn only.
    planted = runs.assign(agree=~((runs.path == "sync 5%") & (runs.turn == runs.turn.max())))
    again = study.report(planted, p).tables["summary"].set_index("path")
    assert again.loc["sync 5%", "agree_pct"] == pytest.approx(100 * (p["turns"] - 2) / (p["turns"] - 1))
    assert again.loc["prefix reuse", "agree_pct"] == 100.0
