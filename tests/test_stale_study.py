"""The stale-fact study's API and report functions (issue 26): parameters, methods, the registry, the endpoints added
to records (answer class, stale indicator, margin recovery), the summary, the paired differences (every compared pair
and each against Shift and Re-prefill, at each budget) and the generated conclusion, on hand-made records; and the
paper presets of notebooks 02 and 03 with the new methods."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sur_lab.studies import STUDIES, get_study
from sur_lab.studies import stale_facts as sf


def test_the_study_is_registered_with_its_api():
    assert STUDIES["stale-facts"] is sf.STUDY and get_study("stale-facts") is sf.STUDY
    p = sf.STUDY.params("default")
    assert p["references"] == ["Dirty", "Shift", "Replay", "Re-prefill", "Erratum"]
    assert sf.STUDY.methods(p)[:5] == p["references"] and sf.STUDY.methods(p)[5:] == list(sf.STUDY_ALLOCATORS)
    assert sf.STUDY.params("smoke", erratum_template="terse")["erratum_template"] == "terse"
    assert sf.STUDY.options(sf.STUDY.params("smoke")) == {}
    assert sf.STUDY.options(sf.STUDY.params("smoke", erratum_template="terse")) == {"erratum_template": "terse"}
    with pytest.raises(ValueError, match="budget is not a parameter"):
        sf.STUDY.params("smoke", budget=[2])


def test_presets_of_notebooks_02_and_03_hold_the_new_methods():
    niah, qa = get_study("niah"), get_study("natural-qa")
    for preset in ("paper", "default"):  # issue 26's paired tables come from notebook 02's default run
        m = niah.methods(niah.params(preset))
        assert m[:5] == ["Dirty", "Shift", "Replay", "Re-prefill", "Erratum"], preset
        assert {"SUR", "SUR-IDF", "Edit-local window", "Edit-local + SUR"} <= set(m[5:]) and "Erratum" not in m[5:]
    q = qa.params("paper")
    assert "Erratum" in qa.methods(q) and {"SUR-IDF", "Edit-local window", "Edit-local + SUR"} <= set(qa.methods(q))
    assert "Erratum" not in qa.methods(qa.params("default"))


def _records(em: dict, stale_answers: dict, n=6, budgets=(2.0, 5.0)):
    """Hand-made records: n cases (alternating families), each method's answer giving the gold value for the cases
    ``em[method]`` lists, the old value for those ``stale_answers[method]`` lists, else a wrong value."""
    rows = []
    methods = [("Dirty", np.nan), ("Shift", np.nan), ("Re-prefill", np.nan), ("Erratum", np.nan)]
    methods += [(m, b) for b in budgets for m in ("SUR", "SUR-IDF", "Edit-local window", "Edit-local + SUR")]
    for i in range(n):
        for method, b in methods:
            key = method if np.isnan(b) else f"{method} {b:g}%"
            good, old = i in em.get(key, ()), i in stale_answers.get(key, ())
            answer = "v2-new" if good else ("v1-old" if old else "nothing")
            margin = {"Shift": 0.0, "Re-prefill": 2.0}.get(method, 1.0 if good else -1.0)
            rows.append({"case_id": f"c{i}", "family": ["value_update", "multi_key"][i % 2], "method": method,
                         "budget_pct": b, "answer": answer, "em": good, "agree_reprefill": good,
                         "gold_value": "v2-new", "stale_value": "v1-old" if i != 5 else "",
                         "distractor_values": "v3-other", "gold_margin": margin, "allowance": 0 if np.isnan(b) else 3,
                         "note_tokens": 7 if method == "Erratum" else 0, "tv_reprefill": 0.1, "refresh_ms": 1.0,
                         "answer_in": "inserted" if i % 2 == 0 else "suffix"})
    return pd.DataFrame(rows)


def test_stale_endpoints_summary_and_paired_differences():
    every = set(range(6))
    em = {"Re-prefill": every, "Erratum": every, "Edit-local window 2%": every, "Edit-local window 5%": every,
          "SUR 5%": {0, 1, 2}}
    stale = {"Shift": every, "Dirty": every, "SUR 2%": every, "SUR-IDF 2%": every, "Edit-local + SUR 2%": every}
    recs = sf.add_stale_endpoints(_records(em, stale))
    shift = recs[recs.method == "Shift"]
    # Case 5 asks an untouched key: no stale value, so its stale indicator is NaN, not 0.
    assert list(shift["answer_class"]) == ["stale"] * 5 + ["wrong"]
    assert shift["stale"].iloc[:5].eq(1.0).all() and np.isnan(shift["stale"].iloc[5])
    assert set(recs.loc[recs.method == "Re-prefill", "margin_recovery"]) == {1.0}
    assert set(recs.loc[recs.method == "Shift", "margin_recovery"]) == {0.0}
    summary = sf.summary_table(recs).set_index(["method", "budget_pct"])
    assert summary.loc[("Shift", np.nan), "stale_pct"] == 100.0 and summary.loc[("Shift", np.nan), "n_stale_cases"] == 5
    assert summary.loc[("SUR", 5.0), "em_pct"] == 50.0 and summary.loc[("Erratum", np.nan), "forward_tokens"] == 7
    assert list(sf.summary_table(recs)["method"][:4]) == ["Dirty", "Shift", "Re-prefill", "Erratum"]
    # Margin recovery as a ratio of sums (Re-prefill gains 2 over Shift on each of 6 cases): the edit-local window
    # (margin 1 everywhere) 6 / 12; SUR 5% (1 on three cases, -1 on three) 0 / 12; the per-case median beside it.
    assert summary.loc[("Edit-local window", 5.0), "margin_recovery"] == 0.5
    assert summary.loc[("SUR", 5.0), "margin_recovery"] == 0.0
    assert summary.loc[("Shift", np.nan), "margin_recovery"] == 0.0
    assert summary.loc[("Re-prefill", np.nan), "margin_recovery"] == 1.0
    assert summary.loc[("Edit-local window", 5.0), "margin_recovery_median"] == 0.5
    assert (summary["margin_recovery_note"] == "").all()
    # Re-prefill no better than Shift on any case: the ratio is undefined, with its reason.
    flat = sf.summary_table(recs.assign(gold_margin=0.0)).set_index(["method", "budget_pct"])
    assert flat["margin_recovery"].isna().all()
    assert flat.loc[("SUR", 5.0), "margin_recovery_note"] == (
        "undefined: Re-prefill's mean margin gain over Shift is 0 logits over 6 cases, below the 0.2 threshold")

    diffs = sf.paired_differences(recs, n_boot=500)
    # One primary and two small declared families (the old all-pairs table held 38 comparisons per endpoint).
    assert list(dict.fromkeys(diffs.family)) == [sf.PRIMARY.name, sf.EM_FAMILY.name, sf.STALE_FAMILY.name]
    assert diffs.groupby("family").size().to_dict() == {sf.PRIMARY.name: 1, sf.EM_FAMILY.name: 8,
                                                        sf.STALE_FAMILY.name: 9}
    by = diffs.set_index(["family", "comparison"])
    primary = by.loc[(sf.PRIMARY.name, "SUR 5% vs Shift")]
    # SUR 5% right on 3 cases Shift gets wrong: 3 discordant pairs cannot separate (exact p = 0.25).
    assert primary.delta == 50.0 and primary.n_discordant == 3 and primary.verdict == "not separated"
    window = by.loc[(sf.EM_FAMILY.name, "Edit-local window 2% vs SUR 2%")]
    # 6 discordant of 6: exact p 1/32, Holm over 8: 0.25, not separated; the old table printed "beats" here.
    assert window.delta == 100.0 and window.p == pytest.approx(1 / 32) and window.verdict == "not separated"
    assert window.delta_low > 0  # the interval alone would have "separated"
    erratum = by.loc[(sf.STALE_FAMILY.name, "Erratum vs Shift")]
    assert np.isnan(erratum.budget_pct) and erratum.n == 5 and erratum.delta == -100.0  # case 5: no stale value
    st = by.loc[(sf.STALE_FAMILY.name, "SUR 2% vs Shift")]
    assert st.n == 5 and st.delta == 0.0 and st.verdict == "not separated" and st.delta_low < 0 < st.delta_high

    lines = sf.conclusion(sf.summary_table(recs), diffs, model="m", n_cases=6, records=recs)
    assert lines[0] == "This run: m; 6 stale-fact cases."
    text = "\n".join(lines)
    # Ties are ties: four arms answer every case at 2 %.
    assert "At 2 %, EM: Edit-local window 2% and Erratum tie at 100 % (the highest of 5 compared arms)" in text
    assert "  Erratum vs Shift: not separated at this size, -100.0 pp" in text
    assert lines[-1] == "Where SUR loses (a separated verdict against it): nowhere in this run."
    assert "beats" not in text.replace("1 beats", "")
    # Without a stale-eligible case the stale rate is n/a, never "stale nan %".
    no_stale = recs.assign(stale=np.nan)
    summary = sf.summary_table(no_stale)
    text = "\n".join(sf.conclusion(summary, sf.paired_differences(no_stale, n_boot=200), model="m", n_cases=6,
                                   records=no_stale))
    assert "Shift EM 0 % (stale n/a (no stale-eligible case))" in text and "nan" not in text
    assert "  SUR 2% vs Shift: n/a (no stale-eligible case)" in text
    smoke = sf.paired_differences(recs, n_boot=200, decide=False)
    assert (smoke.verdict == "not decided").all()
    assert "not decided at this size" in "\n".join(sf.conclusion(sf.summary_table(recs), smoke, model="m", n_cases=6,
                                                                  records=recs, decide=False))
    by_place = sf.stratified_table(recs, "answer_in", "margin_recovery")
    assert by_place.loc["Re-prefill"].tolist() == [1.0, 1.0]
    # SUR 5% is right on cases 0-2: inserted (cases 0, 2, 4) sums 1 + 1 - 1 over 3 x 2; suffix (1, 3, 5) 1 - 1 - 1.
    assert by_place.loc["SUR 5%"].tolist() == [1 / 6, -1 / 6]

    # Gold-margin differences (logits, not x100) within each answer location: the hand-made margins are 1 for a
    # correct answer and -1 otherwise, so the Edit-local window 5% (right everywhere) minus SUR 5% (right on cases
    # 0-2) is (0, 0, 2) on the inserted cases 0, 2, 4 (mean 2/3) and (0, 2, 2) on the suffix cases 1, 3, 5 (4/3).
    margins = sf.margin_differences(recs, n_boot=500)
    assert set(margins.answer_in) == {"inserted", "suffix"} and "verdict" not in margins.columns
    assert len(margins) == 2 * 2 * len(sf.MARGIN_ARMS)
    row = margins[(margins.answer_in == "inserted") & (margins.a == "Edit-local window 5%")]
    assert row.b.iloc[0] == "SUR 5%" and row.delta.iloc[0] == pytest.approx(2 / 3) and row.n.iloc[0] == 3
    row = margins[(margins.answer_in == "suffix") & (margins.a == "Edit-local window 5%")]
    assert row.delta.iloc[0] == pytest.approx(4 / 3) and row.budget_pct.iloc[0] == 5.0
    text = "\n".join(sf.conclusion(sf.summary_table(recs), diffs, model="m", n_cases=6, margins=margins))
    assert "Gold margin (logits, descriptive intervals, not a declared family), answer in the suffix text: " in text
    with pytest.raises(ValueError, match="by="):
        sf.margin_differences(recs, by="nowhere")


def test_add_stale_endpoints_refuses_records_without_the_case_values():
    with pytest.raises(ValueError, match="gold_value"):
        sf.add_stale_endpoints(pd.DataFrame({"answer": ["x"]}))


def test_stale_rates_old_value_pull_and_the_placement_family():
    """Issue 40's report: Shift's stale rate per family with its exact interval and the STALE_REACH claim; the old
    value's pull against Re-prefill per family (case-paired); Erratum against the placement control at equal recency."""
    from sur_lab.analysis.decisions import proportion_interval

    every = set(range(6))
    em = {"Re-prefill": every, "Erratum": {0, 1, 2, 3}, "SUR 5%": every}
    stale = {"Shift": {0}, "Dirty": every}
    recs = _records(em, stale)
    # Old-value pull: Shift's old logit leads by 2 (case 0) or trails by 1; Re-prefill's trails by 3 everywhere.
    pull = {"Shift": lambda i: 2.0 if i == 0 else -1.0, "Re-prefill": lambda i: -3.0}
    recs["old_margin"] = [pull.get(m, lambda i: 0.0)(int(c[1:])) for m, c in zip(recs.method, recs.case_id)]
    late = recs[recs.method.isin(["Shift", "Re-prefill"])].assign(
        case_id=lambda d: d.case_id + "-late", em=True, answer="v2-new", old_margin=-3.0)
    recs = sf.add_stale_endpoints(pd.concat([recs, sf.late_records(late)], ignore_index=True))

    rates = sf.stale_rates(recs).set_index(["family", "arm"])
    # value_update: cases 0, 2, 4 (all stale-eligible); multi_key: 1, 3 (case 5 asks an untouched key).
    shift = rates.loc[("value_update", "Shift")]
    assert (shift.k, shift.n) == (1, 3) and (shift.rate, shift.ci_low, shift.ci_high) == proportion_interval(1, 3)
    assert shift.claim == "not shown"  # 1 of 3: lower bound 0.8 %, below 5 %
    assert (rates.loc[("multi_key", "Shift"), "k"], rates.loc[("multi_key", "Shift"), "n"]) == (0, 2)
    assert rates.loc[("multi_key", "Dirty"), "k"] == 2 and rates.loc[("value_update", "Shift (late)"), "k"] == 0
    assert sf.stale_rates(recs, decide=False)["claim"].eq("not decided").all()
    lines = sf.stale_rate_lines(sf.stale_rates(recs))
    assert lines[0].startswith("value_update: Shift answers the old value in 1 of 3 stale-eligible cases (33 %, 95 % CI")
    assert lines[0].endswith("at least 5 % not shown")

    pulls = sf.old_margin_differences(recs, n_boot=500).set_index(["family", "a"])
    row = pulls.loc[("value_update", "Shift")]
    # Shift minus Re-prefill on cases 0, 2, 4: (5, 2, 2), mean 3; the stale-ineligible case 5 is left out.
    assert row.b == "Re-prefill" and row.delta == pytest.approx(3.0) and row.n == 3
    assert row.mean_a == pytest.approx(0.0) and row.mean_b == -3.0
    assert pulls.loc[("multi_key", "Shift"), "n"] == 2
    assert pulls.loc[("value_update", "Shift (late)"), "b"] == "Re-prefill (late)"
    assert pulls.loc[("value_update", "Shift (late)"), "delta"] == 0.0
    with pytest.raises(ValueError, match="old_margin"):
        sf.old_margin_differences(recs.drop(columns=["old_margin"]))

    diffs = sf.paired_differences(recs, n_boot=200)
    placement = diffs[diffs.family == sf.PLACEMENT_FAMILY.name].set_index("comparison")
    assert list(placement.index) == ["Re-prefill (late) vs Erratum", "Shift (late) vs Erratum"]
    # The late arms answer every case, Erratum 4 of 6: +33 pp on 2 discordant cases (not separated).
    assert placement.loc["Shift (late) vs Erratum", "delta"] == pytest.approx(100 / 3)
    assert placement.loc["Shift (late) vs Erratum", "n"] == 6
    text = "\n".join(sf.conclusion(sf.summary_table(recs), diffs, model="m", n_cases=6, records=recs,
                                   rates=sf.stale_rates(recs), pulls=sf.old_margin_differences(recs, n_boot=200)))
    assert "Stale answers under Shift, per family (exact intervals): value_update: Shift answers" in text
    assert "Old-value pull (old minus gold first-token logit, descriptive intervals), value_update: Shift minus " \
           "Re-prefill +3" in text
    assert sf.PLACEMENT_FAMILY.name in text


def test_sweep_runs_the_placement_control_on_replacement_cases(tmp_path):
    """The sweep adds Shift and Re-prefill on each replacement case's placement control, in their own folder,
    relabelled to pair with the case; deletion cases have none. A tiny float64 model with the real tokenizer."""
    import dataclasses

    from conftest import make_tiny_model

    from sur_lab.models import embedded_tokenizer

    smol_tokenizer = embedded_tokenizer()
    lm = make_tiny_model("llama", vocab_size=len(smol_tokenizer), layers=1, hidden=16, heads=2, kv_heads=1,
                         head_dim=8)
    lm = dataclasses.replace(lm, tokenizer=smol_tokenizer)
    kw = dict(num_cases=3, context_lens=[256], allocators=[], budgets=[5], max_new_tokens=1,
              references=["Shift", "Re-prefill", "Erratum"], families=["superseded_tool_output", "derived_record",
                                                                         "agent_note"])
    records, where, _ = sf.STUDY.sweep(lm, preset="smoke", out=tmp_path / "main", progress=False, **kw)
    assert (tmp_path / "main_late" / "records.parquet").is_file() and sf.control_folder(where) == tmp_path / "main_late"
    late = records[records.method.str.endswith(sf.LATE)]
    fam = dict(zip(records.case_id, records.family))
    # Two replacement cases (derived_record, agent_note) x (Shift, Re-prefill) on the control; none for the deletion.
    assert sorted(late.method) == ["Re-prefill (late)"] * 2 + ["Shift (late)"] * 2
    assert {fam[c] for c in late.case_id} == {"derived_record", "agent_note"}
    assert set(late.case_id) <= set(records.loc[records.method == "Erratum", "case_id"])
    assert (late.layout == "late").all() and (records.loc[~records.method.str.endswith(sf.LATE), "layout"] == "edit").all()
    shift = records[records.method == "Shift"].set_index("case_id")
    for r in late.itertuples():
        assert r.cache_len == shift.loc[r.case_id, "cache_len"]  # a permutation of the edited context
    assert np.isfinite(records["old_margin"]).all()
    assert records.loc[records.method == "Re-prefill (late)", "agree_reprefill"].all()
    diffs = sf.paired_differences(records, n_boot=200, decide=False)
    assert set(diffs.loc[diffs.family == sf.PLACEMENT_FAMILY.name, "n"]) == {2}
