"""SAFE-KV robustness (issue 28, item 5): the hybrid selector, p95 TTFL, the EM-correct stratum, the robustness model's
workloads, the paired donor − forward bootstrap, the Noise64 quality gate (Table 20) and the design ledger's rows."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from conftest import make_tiny_model
from sur_lab.studies import noprefix
from sur_lab.studies.noprefix import (
    RepairSpec,
    compose_tokens,
    design_ledger,
    em_correct,
    hybrid_scores,
    plot_robustness,
    protocol_gap,
    quality_gate,
    query_scores,
    rank_documents,
    rank_scale,
    risk_scores,
    robustness_overrides,
    robustness_table,
    selector_scores,
    stratum_table,
    summarize,
)

K1 = "Suffix K1 · risk"


def row(label, protocol, source, preserved, *, num_docs=4, dataset="hotpotqa", em=False, full_em=False,
        unit="suffix", selector="risk", ttfl=np.nan, full_ttfl=np.nan, ratio=0.5):
    """One runs_table row with the columns the reporting functions read."""
    return {"case_id": f"{dataset}/{source}/n{num_docs}", "dataset": dataset, "source_id": source,
            "num_docs": num_docs, "workload": f"W{num_docs}", "label": label, "method": label.split(" · ")[0],
            "unit": unit, "selector": selector, "protocol": protocol, "preserved": bool(preserved),
            "token_exact": bool(preserved), "em": em, "full_em": full_em,
            "changed_wrong": (not preserved) and (not em), "repair_ratio": ratio, "ttfl_ms": ttfl,
            "full_ttfl_ms": full_ttfl}


# ---------------------------------------------------------------------------------------------------------------------
# Hybrid selector


def test_rank_scale_averages_tied_ranks():
    np.testing.assert_array_equal(rank_scale([0.0, 0.125, 0.0]), [0.5, 1.0, 0.5])  # ranks 1.5, 3, 1.5 over n = 3
    np.testing.assert_array_equal(rank_scale([3.0, 1.0, 2.0, 4.0]), [0.75, 0.25, 0.5, 1.0])


def test_hybrid_selector_averages_the_risk_and_query_ranks():
    lm = make_tiny_model("llama")
    # Document 1 repeats token 10 (risk > 0, the only one); document 2 holds the question tokens (query's best).
    prompt = compose_tokens([1, 2, 3], [[10, 11, 12], [10, 20, 21, 22], [50, 51, 30, 31]], [40],
                            question_ids=[50, 51])
    np.testing.assert_array_equal(risk_scores(prompt), [0.0, 0.125, 0.0])
    query = query_scores(lm, prompt)
    assert rank_documents(query)[0] == 2
    hybrid = hybrid_scores(lm, prompt)
    expected = (np.array([0.5, 1.0, 0.5]) + rank_scale(query)) / 2
    np.testing.assert_allclose(hybrid, expected, rtol=0, atol=0)
    np.testing.assert_array_equal(selector_scores("hybrid", lm, prompt), hybrid)
    # Document 2 is query's top (scale 1) and risk's tied bottom (0.5): 0.75; document 1 is risk's top (1).
    assert hybrid[2] == 0.75 and hybrid[1] == (1.0 + rank_scale(query)[1]) / 2
    with pytest.raises(ValueError, match="lm is required by the hybrid selector"):
        selector_scores("hybrid", None, prompt)
    assert RepairSpec("suffix", "hybrid", 2).label == "Suffix K2 · hybrid"
    assert "Suffix K2 · hybrid" in [s.label for s in noprefix.default_specs([50])]


# ---------------------------------------------------------------------------------------------------------------------
# p95 time to first logit


def test_summarize_reports_p95_beside_the_median_over_timed_requests_only():
    rows = [row(K1, "forward", f"s{i}", True, ttfl=t, full_ttfl=f)
            for i, (t, f) in enumerate([(10.0, 40.0), (11.0, 41.0), (12.0, 42.0), (13.0, 60.0)])]
    rows += [row(K1, "forward", f"u{i}", True) for i in range(3)]  # untimed (batched): NaN TTFL
    s = summarize(pd.DataFrame(rows), by=("label", "protocol")).iloc[0]
    assert s["n"] == 7 and s["timed"] == 4
    assert s["ttfl_ms"] == 11.5 and s["full_ttfl_ms"] == 41.5
    # Linear interpolation at rank 0.95 * (4 - 1) = 2.85: 12 + 0.85 * (13 - 12) and 42 + 0.85 * (60 - 42).
    assert s["ttfl_p95_ms"] == pytest.approx(12.85, abs=1e-12)
    assert s["full_ttfl_p95_ms"] == pytest.approx(57.3, abs=1e-12)
    untimed = summarize(pd.DataFrame(rows[4:]), by=("label", "protocol")).iloc[0]
    assert np.isnan(untimed["ttfl_p95_ms"]) and np.isnan(untimed["full_ttfl_p95_ms"])


# ---------------------------------------------------------------------------------------------------------------------
# EM-correct stratum and the robustness model


def stratum_runs():
    """Four requests; full prefill is gold-correct on s0, s1, s2 (not s3, and s4 has no score). Forward preserves s0,
    s1, s3; donor preserves all."""
    rows = []
    for i, (fem, fwd) in enumerate([(True, True), (True, True), (True, False), (False, True), (None, False)]):
        rows.append(row(K1, "forward", f"s{i}", fwd, full_em=fem))
        rows.append(row(K1, "donor", f"s{i}", True, full_em=fem))
    return pd.DataFrame(rows)


def test_em_correct_stratum_beside_all_requests():
    runs = stratum_runs()
    assert sorted(em_correct(runs)["source_id"].unique()) == ["s0", "s1", "s2"]
    t = stratum_table(runs, by=("label", "protocol")).set_index("protocol")
    assert t.loc["forward", "n"] == 5 and t.loc["forward", "preservation"] == 3 / 5
    assert t.loc["forward", "n_correct"] == 3 and t.loc["forward", "preservation_correct"] == 2 / 3
    assert t.loc["donor", "preservation_correct"] == 1.0 and t.loc["donor", "changed_wrong_correct"] == 0
    assert t.loc["forward", "changed_wrong_correct"] == 1
    # No EM-correct request: the stratum columns are empty, not missing.
    none = stratum_table(runs.assign(full_em=False), by=("label", "protocol"))
    assert (none["n_correct"] == 0).all() and none["preservation_correct"].isna().all()
    with pytest.raises(ValueError, match="full_em"):
        em_correct(runs.drop(columns=["full_em"]))


def test_robustness_table_and_figure_per_model():
    study = stratum_runs()
    other = stratum_runs().assign(preserved=False)
    table = robustness_table({"Qwen": study, "SmolLM2": other}, labels=(K1, "Suffix K2 · query"))
    assert list(table["model"]) == ["Qwen", "Qwen", "SmolLM2", "SmolLM2"]
    assert list(table["protocol"]) == ["forward", "donor"] * 2  # protocols in PROTOCOLS order
    assert table.set_index(["model", "protocol"]).loc[("SmolLM2", "donor"), "preservation"] == 0.0
    assert table.set_index(["model", "protocol"]).loc[("Qwen", "forward"), "preservation_correct"] == 2 / 3
    fig = plot_robustness(table)
    assert len(fig.axes) == 2 and fig.axes[0].get_title().startswith("Qwen\n5 requests; EM-correct 3")
    with pytest.raises(ValueError, match="runs_by_model"):
        robustness_table({})


def test_robustness_model_runs_the_workloads_up_to_sixteen_documents_untimed():
    p = noprefix.STUDY.params("paper")
    assert p["num_docs"] == [4, 16, 64] and p["n_sources"] == [100, 100, 50]
    assert robustness_overrides(p) == {"num_docs": [4, 16], "n_sources": [100, 100], "timed_sources": 0}
    assert robustness_overrides(noprefix.STUDY.params("default")) == {"num_docs": [4, 16], "n_sources": [6, 2],
                                                                "timed_sources": 0}
    assert robustness_overrides(noprefix.STUDY.params("default", robustness_sources=1))["n_sources"] == [1, 1]
    with pytest.raises(ValueError, match="robustness_sources"):
        robustness_overrides(noprefix.STUDY.params("default", robustness_sources=0))
    with pytest.raises(ValueError, match="at most 16 documents"):
        robustness_overrides(noprefix.STUDY.params("default", num_docs=[64], n_sources=[1]))


# ---------------------------------------------------------------------------------------------------------------------
# Paired donor − forward bootstrap


def test_paired_bootstrap_keeps_a_sources_donor_and_forward_rows_together():
    # Sources a and b: donor preserves at 4 documents and forward does not, and the reverse at 16 documents, so each
    # source's donor − forward total is 0; source c agrees everywhere. Resampling sources with all their rows gives
    # exactly 0 in every replicate. Splitting a source's rows (resampling requests or protocols apart) would not.
    rows = []
    for s in ("a", "b"):
        rows += [row(K1, "donor", s, True, num_docs=4), row(K1, "forward", s, False, num_docs=4),
                 row(K1, "donor", s, False, num_docs=16), row(K1, "forward", s, True, num_docs=16)]
    rows += [row(K1, p, "c", True, num_docs=n) for p in ("donor", "forward") for n in (4, 16)]
    gap = protocol_gap(pd.DataFrame(rows))
    assert (gap.diff, gap.low, gap.high, gap.n_sources) == (0.0, 0.0, 0.0, 3)
    assert np.all(gap.replicates == 0.0)
    # The same rows resampled per request instead of per source: replicates vary.
    per_request = pd.DataFrame(rows).assign(source_id=lambda d: d["case_id"])
    assert np.ptp(protocol_gap(per_request).replicates) > 0


def test_paired_bootstrap_interval_values():
    # Donor preserves all four sources, forward two: diff 1/2. A replicate is K/4 with K ~ Binomial(4, 1/2) sources
    # drawn among the two that differ; P(K = 0) = P(K = 4) = 1/16 > 2.5 %, so the 95 % interval is [0, 1].
    rows = [row(K1, "donor", f"s{i}", True) for i in range(4)]
    rows += [row(K1, "forward", f"s{i}", i < 2) for i in range(4)]
    gap = protocol_gap(pd.DataFrame(rows))
    assert (gap.diff, gap.low, gap.high) == (0.5, 0.0, 1.0)
    assert set(np.round(gap.replicates * 4).astype(int)) <= {0, 1, 2, 3, 4}
    with pytest.raises(ValueError, match="label='Suffix K2 · risk'"):
        protocol_gap(pd.DataFrame(rows), "Suffix K2 · risk")
    with pytest.raises(ValueError, match="lacks rows"):
        protocol_gap(pd.DataFrame(rows[:-1] + [row(K1, "forward", "s9", True)]))


# ---------------------------------------------------------------------------------------------------------------------
# Noise64 quality gate (Table 20)


def test_quality_gate_of_the_largest_workload():
    rows = []
    for i in range(4):
        rows.append(row("Full prefill", "forward", f"s{i}", True, num_docs=64, unit="full", selector="", em=i < 3,
                        ttfl=100.0 + i, full_ttfl=100.0 + i, ratio=1.0))
        rows.append(row(K1, "donor", f"s{i}", i < 3, num_docs=64, em=i < 2, ttfl=50.0, full_ttfl=100.0 + i))
        rows.append(row(K1, "forward", f"s{i}", i < 1, num_docs=64, em=i < 1, ttfl=60.0 + 10 * i,
                        full_ttfl=100.0 + i))
        rows.append(row(K1, "forward", f"s{i}", False, num_docs=4))  # another workload: left out
    gate = quality_gate(pd.DataFrame(rows), num_docs=64).set_index("path")
    assert list(gate.index) == ["Full prefill", f"Actual-forwarding {K1}", f"Donor-copy {K1} (diagnostic)"]
    assert gate.loc["Full prefill", "preservation"] == 1.0 and gate.loc["Full prefill", "gold_em"] == 0.75
    fwd = gate.loc[f"Actual-forwarding {K1}"]
    assert fwd["n"] == 4 and fwd["preservation"] == 0.25 and fwd["changed_wrong"] == 3
    assert fwd["ttfl_ms"] == 75.0 and fwd["ttfl_p95_ms"] == pytest.approx(88.5, abs=1e-12)
    assert gate.loc[f"Donor-copy {K1} (diagnostic)", "preservation"] == 0.75
    # Donor − forward per source: 0, 1, 1, 0 -> 0.5, replicates K/4 with K ~ Binomial(4, 1/2): interval [0, 1].
    assert set(gate["donor_minus_forward"]) == {0.5}
    assert set(gate["gap_ci_low"]) == {0.0} and set(gate["gap_ci_high"]) == {1.0}
    with pytest.raises(ValueError, match="num_docs=16"):
        quality_gate(pd.DataFrame(rows), num_docs=16)


# ---------------------------------------------------------------------------------------------------------------------
# Design ledger: the hybrid row and the paired donor row


def ledger_rows(hybrid_hits, n=4):
    rows = []
    for i in range(n):
        rows.append(row("Suffix K2 · risk", "forward", f"s{i}", i < 3 * n // 4))
        rows.append(row("Suffix K2 · query", "forward", f"s{i}", i < n // 2, selector="query"))
        rows.append(row("Suffix K2 · hybrid", "forward", f"s{i}", i < hybrid_hits, selector="hybrid"))
    return rows


def test_design_ledger_hybrid_row():
    name = "Hybrid vs query- and risk-guided start (suffix K2)"
    # Four requests separate nothing: the hybrid row is "not separated" whatever the point estimates say.
    for hits in (2, 3, 4):
        runs = pd.DataFrame(ledger_rows(hits))
        ledger = design_ledger(summarize(runs, by=("label", "protocol")), runs=runs).set_index("experiment")
        assert ledger.loc[name, "verdict"] == "not separated", hits
    # 400 requests: a hybrid that preserves as many as the risk start (300) and more than query (200) is equivalent
    # to risk within 5 points and beats query: it worked; one that preserves 200 loses to risk: it did not.
    for hits, verdict in ((300, "worked"), (200, "did not")):
        runs = pd.DataFrame(ledger_rows(hits, n=400))
        ledger = design_ledger(summarize(runs, by=("label", "protocol")), runs=runs).set_index("experiment")
        assert ledger.loc[name, "verdict"] == verdict, hits
    risk_only = pd.DataFrame(ledger_rows(3)[0::3])
    ledger = design_ledger(summarize(risk_only, by=("label", "protocol")), runs=risk_only)
    assert ledger.set_index("experiment").loc[name, "verdict"] == "not run"


def test_design_ledger_judges_donor_copy_by_the_paired_interval():
    name = "Donor-copy vs actual forwarding (suffix K1, risk)"
    # Donor and forward agree on every one of 6 requests: 0 discordant, but 6 requests cannot show equivalence within
    # 5 points (Newcombe's 90 % interval is wider): not separated, never "worked" from a zero-width interval.
    same = [row(K1, p, f"s{i}", i % 2 == 0) for i in range(6) for p in ("donor", "forward")]
    runs = pd.DataFrame(same)
    pooled = summarize(runs, by=("label", "protocol"))
    ledger = design_ledger(pooled, runs=runs).set_index("experiment")
    assert ledger.loc[name, "verdict"] == "not separated"
    assert "donor vs forward: not separated at this size, +0.0 pp" in ledger.loc[name, "key_result"]
    assert design_ledger(pooled).set_index("experiment").loc[name, "verdict"] == "not run"  # no runs: not judged
    # 400 requests that agree: equivalent within 5 points, a usable proxy.
    many = pd.DataFrame([row(K1, p, f"s{i}", i % 2 == 0) for i in range(400) for p in ("donor", "forward")])
    ledger = design_ledger(summarize(many, by=("label", "protocol")), runs=many).set_index("experiment")
    assert ledger.loc[name, "verdict"] == "worked"
    assert ledger.loc[name, "key_result"].startswith("donor and forward are equivalent within ±5.0 pp")
    # Donor preserves every one of 40 requests, forward half: the difference separates, not a proxy.
    differ = [row(K1, "donor", f"s{i}", True) for i in range(40)] + [row(K1, "forward", f"s{i}", i < 20)
                                                                        for i in range(40)]
    runs = pd.DataFrame(differ)
    ledger = design_ledger(summarize(runs, by=("label", "protocol")), runs=runs).set_index("experiment")
    assert ledger.loc[name, "verdict"] == "did not"
    assert ledger.loc[name, "key_result"].startswith("donor beats forward: +50.0 pp")
    with pytest.raises(ValueError, match="proxy_margin"):
        design_ledger(pooled, proxy_margin=5)
