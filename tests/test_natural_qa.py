"""Natural-QA placements (section 4.3): sources and passages, token-exact restoration of the clean prompt, and the
tables and paired statistics of Tables 7, 9 and 10 on synthetic records (appendix 8.2-8.3)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from sur_lab.data.qa import DATASETS, Passage, QAExample, load_qa
from sur_lab.data.text import PanelConfig, is_eligible, source_rng
from sur_lab.studies.natural_qa import (
    PLACEMENTS,
    aggregate_trials,
    available_methods,
    build_case,
    build_cases,
    choose_passages,
    clean_prompt_ids,
    condition_label,
    dataset_em_table,
    paired_difference_table,
    passage_admissible,
    plot_quality_latency,
    quality_latency_table,
    results_table,
    select_panel,
    transition_table,
)

SUP = (Passage("Alpha", "Alpha was founded in 1901 by Ada.", True), Passage("Beta", "Beta lies in Gamma.", True))


def _example(distractors=(), answers=("Ada",), answer_type="span", supporting=SUP, dataset="hotpotqa", id="q1"):
    return QAExample(id, "Who founded Alpha?", answers, answer_type, supporting, tuple(distractors), dataset)


def _passages(n, prefix="D"):
    return [Passage(f"{prefix}{i}", f"Filler paragraph number {i} about rivers.", False) for i in range(n)]


# --------------------------------------------------------------------------------------------------------------------
# Sources and passages (no model)


def test_panel_config_validation():
    with pytest.raises(ValueError, match="lead"):
        PanelConfig(lead=-1)
    with pytest.raises(ValueError, match="tail"):
        PanelConfig(tail=1.5)
    with pytest.raises(ValueError, match="min_supporting"):
        PanelConfig(min_supporting=1)


def test_passage_admissible():
    ex = _example()
    assert passage_admissible(Passage("Delta", "Rivers run.", False), ex)
    assert not passage_admissible(SUP[0], ex)  # a supporting passage
    assert not passage_admissible(Passage("Alpha", "Other text.", False), ex)  # a supporting title
    assert not passage_admissible(Passage("Delta", "Founded by ADA, in fact.", False), ex)  # leaks the answer
    assert passage_admissible(Passage("Delta", "Adamant rivers.", False), ex)  # whole words only
    assert not passage_admissible(Passage("Delta", "   ", False), ex)
    # yes/no and "none" golds say nothing about leakage
    assert passage_admissible(Passage("Delta", "yes indeed", False), _example(answers=("yes",), answer_type="binary"))
    assert not passage_admissible(
        Passage("Delta", "about 1,000 people", False), _example(answers=("1000",), answer_type="number")
    )


def test_choose_passages_native_first_seeded_and_distinct():
    natives = _passages(6)
    ex = _example(natives)
    cfg = PanelConfig(lead=1, tail=2, seed=3)
    src = choose_passages(ex, cfg, corpus=[])
    assert src == choose_passages(ex, cfg, corpus=[])  # deterministic
    chosen = [src.inserted, *src.lead, *src.tail]
    assert src.origins == ("native",) * 4 and len({p.title for p in chosen}) == 4
    assert set(chosen) <= set(natives)
    assert len(src.lead) == 1 and len(src.tail) == 2
    # the documented draw: the first admissible natives in the per-source permutation
    perm = source_rng(ex, 3).permutation(6)
    assert chosen == [natives[int(i)] for i in perm[:4]]


def test_choose_passages_falls_back_to_corpus_and_rejects_leaks():
    ex = _example([Passage("Native", "Some native distractor.", False)], dataset="iirc", answer_type="spans")
    corpus = [
        Passage("Alpha", "Shares a supporting title.", False),
        Passage("Leak", "Ada founded it.", False),
        Passage("Native", "Some native distractor.", False),  # repeats the native pick
        Passage("C1", "Clean corpus paragraph one.", False),
        Passage("C2", "Clean corpus paragraph two.", False),
    ]
    src = choose_passages(ex, PanelConfig(lead=1, tail=1), corpus=corpus)
    assert src.inserted.title == "Native" and src.origins == ("native", "corpus", "corpus")
    assert {p.title for p in (*src.lead, *src.tail)} == {"C1", "C2"}
    with pytest.raises(ValueError, match="corpus"):
        choose_passages(ex, PanelConfig(lead=2, tail=1), corpus=corpus)
    with pytest.raises(ValueError, match="supporting"):
        choose_passages(_example(supporting=SUP[:1]), PanelConfig(), corpus=corpus)


def test_placement_geometry():
    sup = tuple(Passage(f"S{i}", f"Support {i}.", True) for i in range(3))
    src = choose_passages(_example(_passages(4), supporting=sup), PanelConfig(lead=1, tail=1), corpus=[])
    for placement, n_before in zip(PLACEMENTS, (0, 1, 3)):
        doc = src.passages(placement)
        i = src.insert_index(placement)
        assert doc[i] == src.inserted and doc[:i] + doc[i + 1 :] == src.clean_passages
        assert sum(p.is_supporting for p in doc[:i]) == n_before  # before / between (k // 2) / after the evidence
    with pytest.raises(ValueError, match="placement"):
        src.insert_index("middle")


def test_is_eligible():
    assert is_eligible(_example())
    assert not is_eligible(_example(supporting=SUP[:1]))
    none = _example(answers=("none",), answer_type="none", dataset="iirc")
    assert not is_eligible(none) and is_eligible(none, PanelConfig(include_unanswerable=True))


def test_select_panel_uses_dev_files_nested_and_filters():
    small = select_panel(("iirc", "hotpotqa"), 3, PanelConfig(seed=5))
    large = select_panel(("iirc", "hotpotqa"), 6, PanelConfig(seed=5))
    assert [s.example.dataset for s in small] == ["iirc"] * 3 + ["hotpotqa"] * 3
    ids = lambda srcs, d: [s.example.id for s in srcs if s.example.dataset == d]  # noqa: E731
    assert ids(large, "iirc")[:3] == ids(small, "iirc") and ids(large, "hotpotqa")[:3] == ids(small, "hotpotqa")
    dev_ids = {ex.id for ex in load_qa("hotpotqa")}
    assert set(ids(large, "hotpotqa")) <= dev_ids
    big = select_panel(("iirc",), 60, PanelConfig(seed=1))
    assert all(s.example.answer_type != "none" and len(s.example.supporting) >= 2 for s in big)
    # the passages of a source do not depend on the panel they were drawn in
    assert small[0] == large[0]
    with pytest.raises(ValueError, match="datasets"):
        select_panel(("squad",), 1)
    with pytest.raises(ValueError, match="n_per_dataset"):
        select_panel(("hotpotqa",), 1000)


# --------------------------------------------------------------------------------------------------------------------
# Placement cases on the real tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("dataset", DATASETS)
def test_every_placement_restores_the_clean_prompt(smol_tokenizer, dataset):
    sources = select_panel((dataset,), 8, PanelConfig(lead=1, tail=1, seed=11))
    cases = build_cases(smol_tokenizer, sources)
    assert [c.placement for c in cases[:3]] == list(PLACEMENTS)
    for src_index, src in enumerate(sources):
        clean = clean_prompt_ids(smol_tokenizer, src)
        trio = cases[3 * src_index : 3 * src_index + 3]
        for case in trio:
            e = case.edit
            # deletion restores the clean prompt token for token, and the query follows the document
            assert e.edited_ids.tolist() + e.query_ids.tolist() == clean.tolist()
            assert e.query_ids.tolist() == clean[e.edited_len :].tolist()
            assert e.suffix_len > 0
            # the deleted tokens are exactly the inserted passage (with its separator)
            deleted = smol_tokenizer.decode(e.original_ids[e.prefix_len : e.prefix_len + e.deleted_len])
            assert src.inserted.text.strip() in deleted and f"Title: {src.inserted.title}" in deleted
            assert all(p.text.strip() not in deleted for p in src.example.supporting)
            assert not src.inserted.is_supporting
            assert src.inserted.title not in {p.title for p in src.example.supporting}
            assert case.meta["source_id"] == src.example.id and case.case_id.endswith("/" + case.placement)
        # paired by source: same clean prompt and query, same deleted passage, suffix shrinks before -> after
        assert len({c.edit.deleted_len for c in trio}) == 1
        s = [c.edit.suffix_len for c in trio]
        assert s[0] > s[1] > s[2]
    with pytest.raises(ValueError, match="placements"):
        build_cases(smol_tokenizer, sources, ("before", "before"))


@pytest.mark.slow
def test_iirc_main_passage_and_default_framing(smol_tokenizer):
    src = select_panel(("iirc",), 1, PanelConfig(seed=0))[0]
    case = build_case(smol_tokenizer, src, "after")
    # default framing: one tail passage, so the after-support placement keeps a non-empty suffix
    assert len(src.tail) == 1 and case.edit.suffix_len > 0
    assert src.example.supporting[0].title == ""  # flattened IIRC main passage (its own title is not released)


# --------------------------------------------------------------------------------------------------------------------
# Tables and statistics on synthetic records


def _records(seed=0, n_sources=None, trials=1):
    """Sweep-like records: 3 datasets, sources x 3 placements x conditions, correlated outcomes and timings."""
    rng = np.random.default_rng(seed)
    n_sources = n_sources or {"hotpotqa": 4, "iirc": 3, "musique": 5}
    conds = [("SUR", 2.0), ("SUR", 5.0), ("BM25 (same units)", 5.0), ("Shift", math.nan), ("Replay", math.nan),
             ("Re-prefill", math.nan)]
    rows = []
    for d, n in n_sources.items():
        for s in range(n):
            for p in PLACEMENTS:
                u = rng.random()
                for m, b in conds:
                    threshold = {"Shift": 0.3, "Replay": 0.55, "Re-prefill": 0.6}.get(m, 0.4 + b / 20)
                    correct = bool(u < threshold)
                    for t in range(trials):
                        rows.append({
                            "dataset": d, "source_id": f"{d}-{s}", "placement": p, "method": m, "budget_pct": b,
                            "trial": t, "em": correct, "prediction": "gold" if correct else f"wrong{int(u * 3)}",
                            "select_ms": 0.0 if math.isnan(b) else 1.0 + t, "shift_ms": 0.0 if m != "Shift" and
                            math.isnan(b) else 2.0, "refresh_ms": {"Replay": 30.0, "Re-prefill": 40.0}.get(m, b * 2
                            if not math.isnan(b) else 0.0) + t, "answer_ms": 100.0 + 10 * t,
                        })
    return pd.DataFrame(rows)


def test_condition_label():
    assert condition_label("SUR", 5.0) == "SUR 5%" and condition_label("SUR", 2) == "SUR 2%"
    assert condition_label("Shift", math.nan) == "Shift" and condition_label("Replay", None) == "Replay"


def test_results_table_columns_and_validation():
    table = results_table(_records())
    assert {"condition", "correct", "answer", "latency_ms"} <= set(table.columns)
    row = table.iloc[0]
    assert row.latency_ms == row.select_ms + row.shift_ms + row.refresh_ms + row.answer_ms  # Eq. 20
    with pytest.raises(ValueError, match="records lack"):
        results_table(_records().drop(columns="placement"))
    bad = _records().astype({"em": object})
    bad.loc[0, "em"] = None
    with pytest.raises(ValueError, match="unscored"):
        results_table(bad)


def test_quality_latency_table_matches_hand_computation():
    table = results_table(_records())
    summary = quality_latency_table(table).set_index("condition")
    assert list(summary.index) == ["SUR 2%", "SUR 5%", "BM25 (same units) 5%", "Shift", "Replay", "Re-prefill"]
    for cond, g in table.groupby("condition"):
        assert summary.loc[cond, "em_pct"] == 100 * g.correct.sum() / len(g)
        assert summary.loc[cond, "latency_ms"] == pytest.approx(g.latency_ms.mean(), rel=1e-12)
        assert summary.loc[cond, "refresh_ms"] == pytest.approx(g.refresh_ms.mean(), rel=1e-12)
        ref = table[table.condition == "Re-prefill"].set_index(["dataset", "source_id", "placement"]).answer
        mine = g.set_index(["dataset", "source_id", "placement"]).answer
        agree = (mine == ref.reindex(mine.index)).mean() * 100
        assert summary.loc[cond, "agree_pct"] == pytest.approx(agree, abs=1e-12)
    assert summary.loc["Re-prefill", "speedup_vs_reference"] == 1.0
    with pytest.raises(ValueError, match="reference"):
        quality_latency_table(table, reference="Dirty")


def test_dataset_em_table_pools_counts():
    table = results_table(_records(n_sources={"hotpotqa": 2, "iirc": 5}))
    em = dataset_em_table(table).set_index("condition")
    assert list(em.columns[:2]) == ["HotpotQA", "IIRC"]
    for cond, g in table.groupby("condition"):
        assert em.loc[cond, "Pooled"] == 100 * g.correct.sum() / len(g)  # Eq. 9: counts, not a macro mean
        h = g[g.dataset == "hotpotqa"]
        assert em.loc[cond, "HotpotQA"] == 100 * h.correct.sum() / len(h)


def _brute_force_interval(table, a, b, n_boot, seed):
    """Independent replicate loop over sources (strata and sources sorted), 95% linear-percentile interval."""
    cell = {}
    for r in table.itertuples(index=False):
        if r.condition in (a, b):
            key = (r.dataset, r.source_id)
            cell.setdefault(key, [0.0, 0])
            cell[key][0] += float(r.correct) * (1 if r.condition == a else -1)
            cell[key][1] += r.condition == a
    strata = sorted({d for d, _ in cell})
    members = {d: sorted(k for k in cell if k[0] == d) for d in strata}
    rng = np.random.default_rng(seed)
    draws = [rng.integers(0, len(members[d]), size=(n_boot, len(members[d]))) for d in strata]
    reps = []
    for i in range(n_boot):
        num = den = 0.0
        for d, draw in zip(strata, draws):
            for j in draw[i]:
                num += cell[members[d][j]][0]
                den += cell[members[d][j]][1]
        reps.append(100 * num / den)
    return np.percentile(reps, [2.5, 97.5])


def test_paired_difference_table_matches_brute_force():
    table = results_table(_records(seed=2))
    out = paired_difference_table(table, n_boot=300, seed=7)
    expected = [(b, r) for b in (2.0, 5.0) for r in ("Shift", "Replay", "Re-prefill")]
    assert list(zip(out.budget_pct, out.reference)) == expected
    for row in out.itertuples():
        a, b = condition_label("SUR", row.budget_pct), row.reference
        low, high = _brute_force_interval(table, a, b, 300, 7)
        assert (row.delta_low, row.delta_high) == pytest.approx((low, high), abs=1e-9)
        diff = 100 * (table[table.condition == a].correct.mean() - table[table.condition == b].correct.mean())
        assert row.delta == pytest.approx(diff, abs=1e-9) and row.unit == "pp"
        assert row.n_clusters == 12 and row.n == 36
    with pytest.raises(ValueError, match="method"):
        paired_difference_table(table, method="ProphetKV-Adapted")


def test_paired_difference_keeps_placements_of_a_source_together():
    # Per source, SUR 5% minus Shift is +1, -1, 0 over the three placements: whole-source resampling gives exactly 0.
    rows = []
    for s in range(10):
        for p, (x, y) in zip(PLACEMENTS, [(1, 0), (0, 1), (1, 1)]):
            conds = (("SUR", 5.0, x), ("Shift", math.nan, y), ("Replay", math.nan, y), ("Re-prefill", math.nan, y))
            for m, b, c in conds:
                rows.append({"dataset": "musique", "source_id": s, "placement": p, "method": m, "budget_pct": b,
                             "em": bool(c), "prediction": str(c), "select_ms": 0.0, "shift_ms": 0.0,
                             "refresh_ms": 0.0, "answer_ms": 1.0})
    out = paired_difference_table(results_table(rows), n_boot=200)
    assert np.all(out[["delta", "delta_low", "delta_high"]].to_numpy() == 0.0)


def test_transition_table_counts():
    table = results_table(_records(seed=4))
    out = transition_table(table).set_index("condition")
    assert "Shift" not in out.index
    shift = table[table.condition == "Shift"].set_index(["dataset", "source_id", "placement"]).correct
    for cond, g in table[table.condition != "Shift"].groupby("condition"):
        mine = g.set_index(["dataset", "source_id", "placement"]).correct
        ref = shift.reindex(mine.index)
        assert out.loc[cond, "repairs"] == int((mine & ~ref).sum())
        assert out.loc[cond, "regressions"] == int((~mine & ref).sum())
        assert out.loc[cond, "repairs_pct"] == pytest.approx(100 * (mine & ~ref).mean())
        assert out.loc[cond, "n"] == len(mine)


def test_aggregate_trials_averages_timings_keeps_answers():
    table = results_table(_records(trials=3))
    agg = aggregate_trials(table)
    single = results_table(_records(trials=1))
    assert len(agg) == len(single)
    # timings grow linearly with the trial index (+1 select, +1 refresh, +10 answer ms): the mean is trial 1's
    keys = ["dataset", "source_id", "placement", "condition"]
    merged = agg.merge(table[table.trial == 1], on=keys, suffixes=("", "_t1"))
    np.testing.assert_allclose(merged.latency_ms, merged.latency_ms_t1, rtol=1e-12)
    assert agg.answers_consistent.all() and (agg.trials == 3).all()
    both = agg.merge(single, on=keys, suffixes=("", "_single"))
    assert len(both) == len(single) and (both.correct == both.correct_single).all()
    pd.testing.assert_frame_equal(aggregate_trials(single), single)


def test_plot_quality_latency_and_methods():
    summary = quality_latency_table(results_table(_records()))
    fig = plot_quality_latency(summary, title="synthetic")
    ax = fig.axes[0]
    assert len(ax.lines) == 2  # one line per budgeted method
    assert ax.get_legend() is not None
    methods, missing = available_methods(("SUR", "No-such-allocator"))
    assert methods == ["SUR", "Shift", "Replay", "Re-prefill"] and missing == ["No-such-allocator"]


# --------------------------------------------------------------------------------------------------------------------
# Sweep glue


def _fake_cases():
    from sur_lab.edits import token_edit
    from sur_lab.studies.natural_qa import PlacementCase

    iirc = _example(_passages(2), answers=("1000",), answer_type="number", dataset="iirc", id="q#t9")
    src = choose_passages(iirc, PanelConfig(), corpus=[])
    edit = token_edit([1, 2, 3, 4, 5], 1, 2, [6, 7])
    return [PlacementCase(f"iirc/q#t9/{p}", src, p, edit) for p in ("before", "after")]


def test_sweep_cases_trials_and_scorer():
    from sur_lab.studies.natural_qa import sweep_cases, trial_case_id
    from sur_lab.sweeps import make_scorer

    cases = _fake_cases()
    sc = sweep_cases(cases, trials=2)
    assert [c.case_id for c in sc] == [c.case_id for c in cases] + [trial_case_id(c.case_id, 1) for c in cases]
    assert [c.meta["trial"] for c in sc] == [0, 0, 1, 1]
    assert sc[0].gold == ("1000",) and sc[0].meta["placement"] == "before" and sc[0].meta["source_id"] == "q#t9"
    scorer = make_scorer(cases)
    # DROP normalization (IIRC number): "1,000." after extraction matches "1000", for every trial's case id
    assert scorer(sc[3], "Answer: 1,000.") and not scorer(sc[1], "1001")
    with pytest.raises(ValueError, match="trials"):
        sweep_cases(cases, trials=0)


@pytest.mark.slow
def test_sweep_end_to_end_on_embedded_model(smol, tmp_path):
    from sur_lab.studies.natural_qa import sweep_cases
    from sur_lab.analysis.scoring import extract_answer, score_example
    from sur_lab.sweeps import make_scorer, run_sweep

    src = select_panel(("2wikimultihopqa",), 1, PanelConfig(seed=3))[0]  # a short prompt (322 tokens)
    cases = [build_case(smol.tokenizer, src, "after")]
    records = run_sweep(smol, sweep_cases(cases, trials=2), ["SUR", "Shift", "Re-prefill"], [5], tmp_path,
                        max_new_tokens=2, scorer=make_scorer(cases), progress=False, timed=True)
    table = results_table(records)
    for row in table.itertuples():
        assert row.correct == score_example(extract_answer(row.answer_text), src.example)
        assert row.answer == extract_answer(row.answer_text)
        assert row.latency_ms == pytest.approx(row.select_ms + row.shift_ms + row.refresh_ms + row.answer_ms)
    agg = aggregate_trials(table)
    assert len(agg) == 3 and (agg.trials == 2).all() and agg.answers_consistent.all()
    summary = quality_latency_table(agg).set_index("condition")
    assert summary.loc["Re-prefill", "agree_pct"] == 100.0 and summary.loc["Shift", "shift_ms"] > 0
    assert summary.loc["Shift", "refresh_ms"] == 0 and summary.loc["Re-prefill", "refresh_ms"] > 0


def test_transition_table_on_agreement():
    table = results_table(_records(seed=5).assign(agree_reprefill=lambda d: ~d.em.astype(bool)))
    by_em = transition_table(table).set_index("condition")
    by_agree = transition_table(table, metric_col="agree_reprefill").set_index("condition")
    # agreement is the negation of correctness here, so repairs and regressions swap
    assert (by_agree.repairs == by_em.regressions).all() and (by_agree.regressions == by_em.repairs).all()
    assert (by_em.repairs + by_em.regressions > 0).any()
    with pytest.raises(ValueError, match="metric_col"):
        transition_table(table, metric_col="nope")


def test_latency_comes_from_the_timed_subset_and_never_pools_batched_records():
    """Quality from every case; latency (Eq. 20) only from the records timed per request. Untimed records carry NaN
    answer timings (they were answered in a batch), so pooling them with timed ones is refused."""
    from sur_lab.analysis.stats import check_timing, timed_records

    records = _records()
    timed_ids = set(records["source_id"].unique()[::2])  # a declared subset: every other source
    records = records.assign(timed=records["source_id"].isin(timed_ids), workers=1, threads=1)
    records.loc[~records["timed"], "answer_ms"] = math.nan
    table = results_table(records)
    summary = quality_latency_table(table).set_index("condition")
    full = quality_latency_table(results_table(_records())).set_index("condition")
    assert (summary["cases"] == full["cases"]).all() and (summary["em_pct"] == full["em_pct"]).all()
    sub = table[table["timed"]]
    for cond, row in summary.iterrows():
        assert row["timed_cases"] == (sub["condition"] == cond).sum() < row["cases"]
        assert row["latency_ms"] == pytest.approx(sub.loc[sub["condition"] == cond, "latency_ms"].mean())
    with pytest.raises(ValueError, match=r"answered in a batch .*timed_records"):
        check_timing(table, what="latency")
    with pytest.warns(UserWarning, match="answered in a batch"):
        check_timing(table, what="latency", strict=False)
    check_timing(timed_records(table))
    assert len(timed_records(table)) == len(sub) and len(timed_records(_records())) == len(_records())
    untimed = results_table(records.assign(timed=False))
    with pytest.warns(UserWarning, match="no record was timed"):
        none = quality_latency_table(untimed)
    assert none["latency_ms"].isna().all() and (none["timed_cases"] == 0).all()
    trials = _records(trials=2)
    trials = results_table(trials.assign(timed=trials["trial"] == 0))
    with pytest.raises(ValueError, match="trial timings"):
        aggregate_trials(trials)


def test_declared_families_are_decided_with_sources_as_clusters():
    from sur_lab.studies import natural_qa

    table = results_table(_records(seed=2))
    decided = natural_qa.decide_families(table, n_boot=300, seed=7)
    assert list(dict.fromkeys(decided.family)) == [natural_qa.PRIMARY.name, natural_qa.REFERENCE_FAMILY.name,
                                                   natural_qa.RIVALS.name, natural_qa.LATENCY.name]
    by = decided.set_index(["family", "comparison"])
    primary = by.loc[(natural_qa.PRIMARY.name, "SUR 5% vs Shift")]
    assert primary.adjust == "none" and primary.n == 36 and primary.n_clusters == 12
    # The estimate is the plain paired difference; the test counts sources (clusters), not placements.
    a = table[table.condition == "SUR 5%"].correct.mean() - table[table.condition == "Shift"].correct.mean()
    assert primary.estimate == pytest.approx(a)
    refs = decided[decided.family == natural_qa.REFERENCE_FAMILY.name]
    assert len(refs) == 5 and (refs.family_size == 5).all()  # 2 budgets x 3 references, the primary excepted
    rivals = decided[decided.family == natural_qa.RIVALS.name]
    assert rivals.comparison.tolist() == ["SUR 5% vs BM25 (same units) 5%"]
    latency = decided[decided.family == natural_qa.LATENCY.name].set_index("comparison")
    # Re-prefill: refresh 40 + answer 100 ms; SUR 5%: select 1 + shift 2 + refresh 10 + answer 100 ms.
    assert latency.loc["SUR 5% vs Re-prefill", "estimate"] == pytest.approx(140.0 / 113.0)
    assert latency.loc["SUR 5% vs Re-prefill", "verdict"] == "beats"
    lines = natural_qa.conclusion(decided)
    assert any(line.startswith("  SUR 5% is faster than Re-prefill: 1.24x") for line in lines), lines
    agreement = natural_qa.decide_families(table.assign(agree_reprefill=table.correct), lead="agreement", n_boot=300,
                                           decide=False)
    assert "SUR 5% vs Re-prefill" not in set(agreement[agreement.family != natural_qa.LATENCY.name].comparison)
    assert (agreement.verdict == "not decided").all()
    with pytest.raises(ValueError, match="lead='gold'"):
        natural_qa.decide_families(table, lead="gold")
    with pytest.raises(ValueError, match="agree_reprefill"):
        natural_qa.decide_families(table, lead="agreement")


def test_qa_inputs_take_each_datasets_first_source_id():
    from pathlib import Path

    from transformers import AutoTokenizer

    from sur_lab.data.qa import load_qa
    from sur_lab.data.text import PanelConfig, is_eligible
    from sur_lab.studies.natural_qa import qa_inputs

    qwen_dir = Path("/work/shared/data/tokenizers/qwen2.5-coder-0.5b-instruct")
    if not qwen_dir.is_dir():
        pytest.skip("the shared Qwen tokenizer is not here")
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    cases = qa_inputs(tok, ["hotpotqa", "iirc"])
    config = PanelConfig()
    for case, name in zip(cases, ["hotpotqa", "iirc"]):
        first = min(str(ex.id) for ex in load_qa(name, split="dev") if is_eligible(ex, config))
        assert case.case_id == f"{name}/{first}/before" and case.placement == "before"
    assert [c.case_id for c in qa_inputs(tok, ["hotpotqa", "iirc"])] == [c.case_id for c in cases]
    with pytest.raises(ValueError, match="datasets"):
        qa_inputs(tok, ["nope"])
    with pytest.raises(ValueError, match="placement"):
        qa_inputs(tok, ["iirc"], placement="middle")
