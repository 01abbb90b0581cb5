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
    assert STUDIES["stale-facts"] == "sur_lab.studies.stale_facts" and get_study("stale-facts") is sf
    p = sf.params("default")
    assert p["references"] == ["Dirty", "Shift", "Replay", "Re-prefill", "Erratum"]
    assert sf.methods(p)[:5] == p["references"] and sf.methods(p)[5:] == list(sf.STUDY_ALLOCATORS)
    assert sf.params("smoke", erratum_template="terse")["erratum_template"] == "terse"
    assert sf._options(sf.params("smoke")) == {} and sf._options(sf.params("smoke", erratum_template="terse")) == {
        "erratum_template": "terse"}
    with pytest.raises(ValueError, match="budget is not a parameter"):
        sf.params("smoke", budget=[2])


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
    assert primary.diff_pp == 50.0 and primary.n_discordant == 3 and primary.verdict == "not separated"
    window = by.loc[(sf.EM_FAMILY.name, "Edit-local window 2% vs SUR 2%")]
    # 6 discordant of 6: exact p 1/32, Holm over 8: 0.25, not separated; the old table printed "beats" here.
    assert window.diff_pp == 100.0 and window.p == pytest.approx(1 / 32) and window.verdict == "not separated"
    assert window.ci_low_pp > 0  # the interval alone would have "separated"
    erratum = by.loc[(sf.STALE_FAMILY.name, "Erratum vs Shift")]
    assert np.isnan(erratum.budget_pct) and erratum.n_cases == 5 and erratum.diff_pp == -100.0  # case 5: no stale value
    st = by.loc[(sf.STALE_FAMILY.name, "SUR 2% vs Shift")]
    assert st.n_cases == 5 and st.diff_pp == 0.0 and st.verdict == "not separated" and st.ci_low_pp < 0 < st.ci_high_pp

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
    assert row.b.iloc[0] == "SUR 5%" and row.diff_logit.iloc[0] == pytest.approx(2 / 3) and row.n_cases.iloc[0] == 3
    row = margins[(margins.answer_in == "suffix") & (margins.a == "Edit-local window 5%")]
    assert row.diff_logit.iloc[0] == pytest.approx(4 / 3) and row.budget_pct.iloc[0] == 5.0
    text = "\n".join(sf.conclusion(sf.summary_table(recs), diffs, model="m", n_cases=6, margins=margins))
    assert "Gold margin (logits, descriptive intervals, not a declared family), answer in the suffix text: " in text
    with pytest.raises(ValueError, match="by="):
        sf.margin_differences(recs, by="nowhere")


def test_add_stale_endpoints_refuses_records_without_the_case_values():
    with pytest.raises(ValueError, match="gold_value"):
        sf.add_stale_endpoints(pd.DataFrame({"answer": ["x"]}))
