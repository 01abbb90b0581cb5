"""The sweep pipeline (sur_lab.sweeps): one record per (case, method, budget), shared per-case state, exact resume;
NR_TV (Eq. 14)."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pandas as pd
import pytest

import sur_lab.sweeps.case as case_mod
from conftest import make_tiny_model
from sur_lab.budget import allowance
from sur_lab.analysis.endpoints import nr_tv, reference_continuation
from sur_lab.analysis.scoring import extract_answer
from sur_lab.studies.niah import build_niah_case, niah_scorer, parse_niah_answer
from sur_lab.sweeps import TIMING_FIELDS, Case, case_seed, run_case, run_sweep
from sur_lab.studies.niah import budget_table
from test_allocators import char_tokenizer
from test_niah import CORPUS

METHODS = ("Dirty", "Shift", "Replay", "Re-prefill", "SUR", "Random semantic units", "ProphetKV-Adapted")
BUDGETS = (5, 37)


@pytest.fixture(scope="module")
def lm():
    return dataclasses.replace(make_tiny_model("llama"), tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def cases(lm):
    out = []
    # Both cases delete the earlier needle, so the suffix is long enough for budgets below 100 %.
    for i, (depths, delete) in enumerate([((0.2, 0.6), 0), ((0.7, 0.3), 1)]):
        case = build_niah_case(lm.tokenizer, CORPUS, context_len=300, depths=depths, delete=delete, seed=i)
        out.append(dataclasses.replace(case.sweep_case(), case_id=f"case/{i}"))
    return out


def _comparable(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=list(TIMING_FIELDS)).reset_index(drop=True)


def test_nr_tv_is_eq14():
    assert nr_tv(0.1, 0.4) == pytest.approx(0.75)
    assert nr_tv(0.0, 0.4) == 1.0 and nr_tv(0.4, 0.4) == 0.0
    assert nr_tv(0.6, 0.3) == pytest.approx(-1.0)  # not clipped
    assert math.isnan(nr_tv(0.1, 0.0)) and math.isnan(nr_tv(float("nan"), 0.2))
    with pytest.raises(ValueError, match="tv_method"):
        nr_tv(1.5, 0.2)
    assert reference_continuation((5, 6, 7), 2) == [5, 6]


def test_sweep_writes_one_record_per_case_method_budget(lm, cases, tmp_path):
    df = run_sweep(lm, cases, METHODS, BUDGETS, tmp_path, max_new_tokens=6, parser=parse_niah_answer,
                   scorer=niah_scorer, seed=3, progress=False, timed=True)
    assert df.timed.all()
    assert len(df) == 2 * (4 + 3 * 2)
    stored = pd.read_parquet(tmp_path / "records.parquet")
    keys = ["case_id", "method", "budget_pct", "answer", "em", "tv_reprefill"]
    assert stored[keys].equals(df[keys])
    for case in cases:
        rows = df[df.case_id == case.case_id]
        S = case.edit.suffix_len
        ref = rows[rows.method == "Re-prefill"].iloc[0]
        assert ref.tv_reprefill == 0.0 and ref.nr_tv == 1.0 and ref.agree_reprefill
        dirty = rows[rows.method == "Dirty"].iloc[0]
        assert dirty.nr_tv == pytest.approx(0.0, abs=1e-12)
        assert dirty.tv_reprefill == pytest.approx(dirty.tv_dirty_reprefill)
        assert rows[rows.method.isin(["Dirty", "Shift", "Replay", "Re-prefill"])].budget_pct.isna().all()
        for _, r in rows[rows.budget_pct.notna()].iterrows():
            assert r.allowance == allowance(S, r.budget_pct) == len(r.positions)
            assert r.num_intervals == len(r.intervals)
            assert sum(b - a for a, b in r.intervals) == r.allowance
            assert r.latency_ms == pytest.approx(r.select_ms + r.shift_ms + r.refresh_ms + r.answer_ms)
            assert r.case_seed == case_seed(3, case.case_id)
            assert r.em == (tuple(json.loads(r.prediction)) == tuple(r.gold))
            assert r.agree_reprefill == (r.prediction == ref.prediction)
        prophet = rows[rows.method == "ProphetKV-Adapted"]
        assert (prophet.allowance < S).all()
        assert (prophet.extra_forward_tokens == case.edit.query_ids.numel()).all()
        assert (rows.context_len == 300).all() and (rows.model == "tiny-llama").all()
        assert (rows.nll_tokens == ref.nll_tokens).all()
        assert ref.nll_tokens == 0 or np.isfinite(rows.nll_reprefill).all()
    table = budget_table(df)
    assert list(table.columns) == ["Reference", "5%", "37%"]
    assert table.loc["Re-prefill", "Reference"] == 100.0


def test_shift_cache_and_references_are_computed_once_per_case(lm, cases, tmp_path, monkeypatch):
    calls = {"prepare": 0, "Re-prefill": 0}
    real_prepare, real_repair = case_mod.prepare, case_mod.repair

    def counting_prepare(*args, **kwargs):
        calls["prepare"] += 1
        return real_prepare(*args, **kwargs)

    def counting_repair(lm_, prepared, method="SUR", *args, **kwargs):
        calls[method] = calls.get(method, 0) + 1
        return real_repair(lm_, prepared, method, *args, **kwargs)

    monkeypatch.setattr(case_mod, "prepare", counting_prepare)
    monkeypatch.setattr(case_mod, "repair", counting_repair)
    run_sweep(lm, cases, METHODS, BUDGETS, tmp_path, max_new_tokens=3, progress=False)
    assert calls["prepare"] == 2 and calls["Re-prefill"] == 2 and calls["Dirty"] == 2 and calls["SUR"] == 4


def test_sweep_resumes_after_a_crash_with_identical_records(lm, cases, tmp_path):
    kwargs = dict(max_new_tokens=5, parser=parse_niah_answer, seed=1, progress=False)
    full = run_sweep(lm, cases, METHODS, BUDGETS, tmp_path / "full", scorer=niah_scorer, **kwargs)
    calls = {"n": 0}

    def crashing_scorer(case, text):
        calls["n"] += 1
        if calls["n"] == 13:  # the 13th record (in the second case) never gets written
            raise KeyboardInterrupt
        return niah_scorer(case, text)

    with pytest.raises(KeyboardInterrupt):
        run_sweep(lm, cases, METHODS, BUDGETS, tmp_path / "crash", scorer=crashing_scorer, **kwargs)
    parts = sorted((tmp_path / "crash" / "parts").glob("*.jsonl"))
    assert sum(len(p.read_text().splitlines()) for p in parts) == 12
    before = {p.name: p.read_text() for p in parts}
    # A torn line (a crash while writing) is ignored and recomputed.
    with parts[-1].open("a") as fh:
        fh.write('{"method": "SUR", "budget')
    resumed_calls = {"n": 0}

    def counting_scorer(case, text):
        resumed_calls["n"] += 1
        return niah_scorer(case, text)

    with pytest.warns(UserWarning, match=r"\.jsonl:3: not a valid sweep record \(torn"):
        resumed = run_sweep(lm, cases, METHODS, BUDGETS, tmp_path / "crash", scorer=counting_scorer, **kwargs)
    assert resumed_calls["n"] == len(full) - 12  # finished records are not recomputed
    pd.testing.assert_frame_equal(_comparable(resumed), _comparable(full))
    for name, text in before.items():  # finished records are kept byte for byte
        assert (tmp_path / "crash" / "parts" / name).read_text().startswith(text)
    again = run_sweep(lm, cases, METHODS, BUDGETS, tmp_path / "crash", scorer=counting_scorer, **kwargs)
    assert resumed_calls["n"] == len(full) - 12
    pd.testing.assert_frame_equal(again, resumed)


def test_resume_refuses_records_of_another_configuration(lm, cases, tmp_path):
    run_sweep(lm, cases[:1], ("Shift",), (), tmp_path, max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match="out_dir.*max_new_tokens"):
        run_sweep(lm, cases[:1], ("Shift",), (), tmp_path, max_new_tokens=3, progress=False)
    changed = dataclasses.replace(cases[1], case_id=cases[0].case_id)
    with pytest.raises(ValueError, match="case_fingerprint"):
        run_sweep(lm, [changed], ("Shift",), (), tmp_path, max_new_tokens=2, progress=False)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"methods": ("Nope",)}, "Nope"),
        ({"budgets": (120,)}, "budget_pct"),
        ({"executor": "nope"}, "executor"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_sweep_validates_before_any_work(lm, cases, tmp_path, kwargs, match):
    args = {"methods": ("SUR",), "budgets": (5,), **kwargs}
    with pytest.raises(ValueError, match=match):
        run_sweep(lm, cases, out_dir=tmp_path, progress=False, **args)
    assert not (tmp_path / "records.parquet").exists()


def test_sweep_rejects_duplicate_ids_and_nested_meta(lm, cases, tmp_path):
    with pytest.raises(ValueError, match="unique"):
        run_sweep(lm, [cases[0], cases[0]], ("Shift",), (), tmp_path, progress=False)
    with pytest.raises(ValueError, match="meta"):
        Case("x", cases[0].edit, meta={"nested": [1, 2]})
    with pytest.raises(ValueError, match="collides"):
        Case("x", cases[0].edit, meta={"method": "a"})
    with pytest.raises(ValueError, match="Case objects"):
        run_sweep(lm, [cases[0].edit], ("Shift",), (), tmp_path, progress=False)


def test_default_scoring_uses_extracted_answers_and_gold_aliases(lm, cases, tmp_path):
    case = dataclasses.replace(cases[0], gold=("zzz",))
    df = run_sweep(lm, [case], ("Re-prefill", "Shift"), (), tmp_path, max_new_tokens=4, progress=False)
    assert df.em.tolist() == [False, False]
    assert df.prediction.tolist() == [extract_answer(a) for a in df.answer]
    no_gold = dataclasses.replace(cases[0], gold=())
    df2 = run_sweep(lm, [no_gold], ("Shift",), (), tmp_path / "b", max_new_tokens=4, progress=False)
    assert df2.em.isna().all()


def _synthetic_records(values: dict[str, tuple[float, float]]) -> pd.DataFrame:
    rows = []
    for method, (v2, v5) in values.items():
        for budget, v in ((2.0, v2), (5.0, v5)):
            rows += [{"method": method, "budget_pct": budget, "agree_reprefill": x < v, "num_intervals": 1}
                     for x in (0.25, 0.75)]
    rows.append({"method": "Shift", "budget_pct": float("nan"), "agree_reprefill": True, "num_intervals": 0})
    return pd.DataFrame(rows)


def test_table12_orders_rules_and_counts_concordant_pairs():
    from sur_lab.studies.niah import PAPER_TABLE12, order_concordance, table12, table12_concordance

    values = {  # fraction of the two synthetic cases that agree (0, 0.5 or 1)
        "Random semantic units": (0.0, 0.0), "SUR": (1.0, 1.0), "Dense tokens": (0.0, 0.5),
        "Max-relevance contiguous": (0.5, 0.5), "BM25 (same units)": (0.5, 1.0),
    }
    ours = table12(_synthetic_records(values))
    assert list(ours.index) == ["SUR", "Dense tokens", "Max-relevance contiguous", "BM25 (same units)",
                                "Random semantic units"]
    assert ours["2%"].tolist() == [100.0, 0.0, 50.0, 50.0, 0.0]
    assert ours["5%"].tolist() == [100.0, 50.0, 50.0, 100.0, 0.0]
    assert order_concordance([3, 2, 1], [3, 1, 2]) == (2, 1, 0)
    assert order_concordance([1, 1, 2], [1, 2, 3]) == (2, 0, 1)
    conc = table12_concordance(ours).set_index(["budget", "paper_model"])
    paper_2 = [row[0] for row in PAPER_TABLE12["Qwen3-8B"]]  # 89.6, 7.3, 75.0, 82.3, 2.1
    assert tuple(conc.loc[("2%", "Qwen3-8B")]) == order_concordance(ours["2%"].tolist(), paper_2) == (8, 0, 2)
    with pytest.raises(ValueError, match="lack"):
        table12(_synthetic_records({"SUR": (1.0, 1.0)}))


def test_budget_table_and_figures_cover_every_method(lm, cases, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from sur_lab.studies.niah import plot_budget_curves, plot_intervals

    df = run_sweep(lm, cases, ("Shift", "Re-prefill", "SUR", "Dense tokens"), (5, 37), tmp_path, max_new_tokens=2,
                   progress=False)
    table = budget_table(df, "tv_reprefill", scale=1.0)
    assert list(table.index) == ["Shift", "Re-prefill", "SUR", "Dense tokens"]
    assert table.loc["SUR", "5%"] == pytest.approx(df[(df.method == "SUR") & (df.budget_pct == 5)].tv_reprefill.mean())
    with pytest.raises(ValueError, match="value"):
        budget_table(df, "nope")
    fig = plot_budget_curves(df, ["agree_reprefill", "nr_tv"], agg={"nr_tv": "median"})
    assert len(fig.axes) == 2 and all(len(ax.lines) == 2 + 2 for ax in fig.axes)  # 2 allocators + 2 references
    sur = fig.axes[1].lines[0]
    expected = df[df.method == "SUR"].groupby("budget_pct").nr_tv.median()
    np.testing.assert_allclose(sur.get_ydata(), expected.values)
    with pytest.raises(ValueError, match="metrics"):
        plot_budget_curves(df, ["nope"])
    assert len(plot_intervals(df).axes[0].patches) >= 4  # one box per (allocator, budget)


def test_seeded_subset_is_nested_declared_and_independent_of_order():
    from sur_lab.sweeps import seeded_subset

    ids = [f"c{i}" for i in range(20)]
    subsets = [seeded_subset(ids, k, seed=3) for k in range(21)]
    assert [len(s) for s in subsets] == list(range(21))
    for small, big in zip(subsets, subsets[1:]):
        assert set(small) < set(big)  # nested: raising k keeps the cases already timed
    assert subsets[5] == [i for i in ids if i in subsets[5]]  # input order
    assert seeded_subset(list(reversed(ids)), 5, seed=3) == list(reversed(subsets[5]))  # the same ids, any order
    assert seeded_subset(ids, 5, seed=4) != subsets[5]
    assert seeded_subset(ids, None) == ids and seeded_subset(ids, 0) == []
    with pytest.raises(ValueError, match="k must be"):
        seeded_subset(ids, -1)


def test_timed_cases_are_checked_and_recorded(lm, cases, tmp_path):
    with pytest.raises(ValueError, match="timed names case ids"):
        run_sweep(lm, cases, ("Shift",), (), tmp_path, timed=["nope"], progress=False)
    df = run_sweep(lm, cases, ("Shift", "Re-prefill"), (), tmp_path, max_new_tokens=2, timed=[cases[1].case_id],
                   progress=False)
    assert df.groupby("case_id")["timed"].all().to_dict() == {cases[0].case_id: False, cases[1].case_id: True}
    assert df[~df.timed].answer_ms.isna().all() and df[df.timed].answer_ms.notna().all()
    assert json.loads((tmp_path / "sweep.json").read_text())["timed_cases"] == [cases[1].case_id]
    # Resuming with another timed subset would mix records timed and untimed: refused, naming the field.
    with pytest.raises(ValueError, match="another timed"):
        run_sweep(lm, cases, ("Shift", "Re-prefill"), (), tmp_path, max_new_tokens=2, timed=True, progress=False)


@pytest.mark.parametrize("bad, why", [
    ('{"case_id": "case/0", "answer": "x"}', "field 'method' is missing"),  # valid JSON, not a record
    ("\x00\x01 garbage", "not JSON"),  # unreadable
    ("", "empty line"),
    ({"em": "yes"}, "field 'em' must be bool?"),  # a record with a field of the wrong type
    ("other-case", "a record of case 'case/1', not 'case/0'"),  # a record of another case in this case's file
    # Issue 38: ranges from the schema, and no key beyond the record's fields and its case's columns.
    ({"tv_reprefill": 37.5}, "field 'tv_reprefill' must be in [0.0, 1.0]; got 37.5"),  # a TV written as a percent
    ({"jsd_reprefill": 0.9}, "field 'jsd_reprefill' must be in [0.0, 0.69"),  # above ln 2 nats
    ({"em": 2}, "field 'em' must be bool?"),  # EM in {0, 1}: stored as a bool
    ({"nll_reprefill": -0.25}, "field 'nll_reprefill' must be in >= 0.0"),
    ({"refresh_ms": -1.0}, "field 'refresh_ms' must be in >= 0.0"),
    ({"budget_pct": 500.0}, "field 'budget_pct' must be in [0.0, 100.0]"),
    ({"allowance": -3}, "field 'allowance' must be in >= 0"),
    ({"threads": 0}, "field 'threads' must be in >= 1"),
    ({"extra_column": 1}, "unknown key 'extra_column'"),  # reused, it would add a column to the table
    ({"context_len": None}, "the case's column 'context_len' is missing"),  # None: the key is removed
])
def test_invalid_stored_lines_are_reported_with_file_and_line_and_recomputed(lm, cases, tmp_path, bad, why):
    """Issue 24: every part-file line is validated against the record schema; a line that is not a valid record of
    its case is reported (warning naming the file and line), dropped and its record recomputed, never a crash."""
    kwargs = dict(max_new_tokens=2, parser=parse_niah_answer, scorer=niah_scorer, progress=False)
    full = run_sweep(lm, cases, ("Shift", "Re-prefill", "SUR"), (5,), tmp_path, **kwargs)
    part = next(p for p in (tmp_path / "parts").glob("*.jsonl") if p.name.startswith("case_0"))
    lines = part.read_text().splitlines()
    at = 1  # line 2 is replaced: its record is lost
    if isinstance(bad, dict):
        at = next(i for i, x in enumerate(lines) if json.loads(x)["method"] == "SUR")  # every field defined
        rec = json.loads(lines[at])
        for key, value in bad.items():
            if value is None:
                del rec[key]
            else:
                rec[key] = value
        bad = json.dumps(rec)
    elif bad == "other-case":
        other = next(p for p in (tmp_path / "parts").glob("*.jsonl") if p.name.startswith("case_1"))
        bad = other.read_text().splitlines()[0]
    part.write_text("\n".join([*lines[:at], bad, *lines[at + 1:]]) + "\n")
    with pytest.warns(UserWarning, match=rf"{part.name}:{at + 1}: not a valid sweep record \({re.escape(why)}"):
        again = run_sweep(lm, cases, ("Shift", "Re-prefill", "SUR"), (5,), tmp_path, **kwargs)
    pd.testing.assert_frame_equal(_comparable(again), _comparable(full))  # no column gained, no value reused
    kept = part.read_text().splitlines()
    assert kept[0] == lines[0] and len(kept) == len(lines)  # valid lines kept byte for byte; the lost one recomputed
    assert all(json.loads(x)["case_id"] == "case/0" for x in kept)


def test_record_round_trips_through_a_json_line_and_a_parquet_row(lm, cases, tmp_path):
    from sur_lab.sweeps import FIELD_NAMES, Record, parse_line, records_frame
    from sur_lab.sweeps.record import frame_records

    recs = run_case(lm, cases[0], ("Dirty", "Shift", "SUR"), (5,), max_new_tokens=2, parser=parse_niah_answer)
    other = dataclasses.replace(recs[0], case_id="x", meta={"only_here": 1.5})
    recs = [*recs, other]
    for r in recs:  # compared as lines: NaN fields (the references' budget, untimed answers) are never == themselves
        assert parse_line(r.to_line()).to_line() == r.to_line()
        assert isinstance(r.positions, tuple) and all(isinstance(p, int) for p in r.positions)
    df = records_frame(recs)
    assert list(df.columns)[-len(FIELD_NAMES):] == list(FIELD_NAMES)  # meta columns first, then the schema
    records_frame(recs[:-1]).to_parquet(tmp_path / "r.parquet", index=False)
    back = frame_records(pd.read_parquet(tmp_path / "r.parquet"))
    assert [r.to_line() for r in back] == [r.to_line() for r in recs[:-1]]
    mixed = frame_records(df)  # a meta column some records lack is not added to them
    assert "only_here" not in mixed[0].meta and mixed[-1].meta == {"only_here": 1.5}
    with pytest.raises(ValueError, match="field 'threads' must be int"):
        Record.from_json({**recs[0].to_json(), "threads": "two"})
    with pytest.raises(ValueError, match="collides with a record field"):
        dataclasses.replace(recs[0], meta={"method": "x"})
    empty = records_frame([])
    assert list(empty.columns) == list(FIELD_NAMES) and empty.empty


@pytest.mark.parametrize("stored", [1, 3, 6])
def test_a_resumed_case_equals_an_uninterrupted_one_bit_for_bit(cases, stored):
    """Issue 38: a case's records are answered in batches cut from the whole grid, whatever is already stored (its
    stored rows are dropped after the fact), so the records a resume makes equal an uninterrupted run's bit for bit:
    float32 logits digests and NLLs included, on this machine. (Batches of other compositions pad and sum otherwise:
    the float32 endpoints then differ in their last bits.)"""
    from sur_lab.sweeps import comparable_fields

    import torch

    lm32 = dataclasses.replace(make_tiny_model("llama", dtype=torch.float32), tokenizer=char_tokenizer())
    kwargs = dict(max_new_tokens=4, eval_batch=4, parser=parse_niah_answer, scorer=niah_scorer, seed=2)
    full = run_case(lm32, cases[0], METHODS, BUDGETS, **kwargs)
    skip = {r.key for r in full[:stored]}
    resumed = run_case(lm32, cases[0], METHODS, BUDGETS, skip=skip, **kwargs)
    assert [r.key for r in resumed] == [r.key for r in full[stored:]]

    def line(rec) -> str:
        return json.dumps(comparable_fields(rec), sort_keys=True)  # NaN written as NaN: equal lines, equal records

    assert [line(r) for r in resumed] == [line(r) for r in full[stored:]]


def test_a_records_parquet_without_parts_is_checked_before_it_is_overwritten(lm, cases, tmp_path, monkeypatch):
    """Issue 38: a finished folder whose parts/ was deleted holds its only copy of the records in records.parquet.
    A sweep with another configuration into it is refused, naming out_dir (the file stays byte for byte); one with the
    same configuration writes the records back as part files and resumes them (nothing recomputed, nothing lost, also
    for the cases it does not run)."""
    import shutil

    kwargs = dict(max_new_tokens=2, parser=parse_niah_answer, scorer=niah_scorer, progress=False)
    full = run_sweep(lm, cases, ("Shift", "Re-prefill"), (), tmp_path, seed=1, **kwargs)
    shutil.rmtree(tmp_path / "parts")
    before = (tmp_path / "records.parquet").read_bytes()
    with pytest.raises(ValueError, match=rf"out_dir='{re.escape(str(tmp_path))}' holds a record of case 'case/0' "
                                         r"made with another seed \(1 vs 2 now\).*in records.parquet and no part file "
                                         r"holds it.*not overwritten"):
        run_sweep(lm, cases, ("Shift", "Re-prefill"), (), tmp_path, seed=2, **kwargs)
    assert (tmp_path / "records.parquet").read_bytes() == before and not (tmp_path / "parts").exists()
    calls = []
    monkeypatch.setattr(case_mod, "repair", lambda *a, **k: calls.append(a) or pytest.fail("recomputed"))
    again = run_sweep(lm, cases[:1], ("Shift", "Re-prefill"), (), tmp_path, seed=1, **kwargs)
    assert calls == [] and len(again) == 2
    pd.testing.assert_frame_equal(again, full[full.case_id == "case/0"].reset_index(drop=True))
    assert len(list((tmp_path / "parts").glob("*.jsonl"))) == 2  # case/1's records are kept in its part file
    resumed = run_sweep(lm, cases, ("Shift", "Re-prefill"), (), tmp_path, seed=1, **kwargs)
    pd.testing.assert_frame_equal(resumed, full)


def test_a_damaged_records_parquet_without_parts_is_not_overwritten(lm, cases, tmp_path):
    (tmp_path / "records.parquet").write_bytes(b"PAR1 not a parquet file")
    with pytest.raises(ValueError, match=r"out_dir=.*records.parquet cannot be read as records.*not overwritten"):
        run_sweep(lm, cases[:1], ("Shift",), (), tmp_path, max_new_tokens=2, progress=False)
    assert (tmp_path / "records.parquet").read_bytes() == b"PAR1 not a parquet file"


def test_field_types_are_read_from_the_record_annotations():
    # Checked equal to the literal FIELD_TYPES that sweeps/record.py declared before issue 39 (then deleted, so the
    # schema is declared once): each annotation form maps to its stored type, and an unknown one is refused.
    from sur_lab.sweeps import record as rec

    types = rec.FIELD_TYPES
    assert list(types) == list(rec.FIELD_NAMES)
    assert (types["case_id"], types["seed"], types["budget_pct"], types["timed"]) == ("str", "int", "float", "bool")
    assert (types["tied_units"], types["em"]) == ("int?", "bool?")
    assert (types["positions"], types["gold"], types["intervals"]) == ("ints", "strs", "intervals")
    assert {types[t] for t in TIMING_FIELDS} == {"float"}
    assert set(types.values()) == set(rec._KINDS.values())

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Wider(rec.Record):
        ratio: complex = 0j

    with pytest.raises(TypeError, match=r"Wider fields with no stored type .*ratio: <class 'complex'>"):
        rec._field_types(Wider)
