"""The claims table: a registry of the paper's claims, SAFE-KV's rules and the questions beyond them, rendered from a
results folder; rows that are not computed say so and never carry a verdict, and every verdict comes from one
function that maps the decisions module's words."""

from __future__ import annotations

import csv
import io
import json
import math
import re

import numpy as np
import pandas as pd
import pytest

from sur_lab.analysis.decisions import paired_family, proportion_interval
from sur_lab.runtime import claims as cl
from sur_lab.runtime.run_notebooks import notebooks
from sur_lab.studies.noprefix import decided_table

STEMS = {p.stem for p in notebooks("*")}


def test_registry_rows_are_well_formed():
    ids = [c.id for c in cl.CLAIMS]
    assert len(ids) == len(set(ids))
    assert {c.source for c in cl.CLAIMS} == {"paper", "SAFE-KV", "beyond the papers"}
    for c in cl.CLAIMS:
        assert c.notebook in STEMS, c.id
        assert c.table.startswith(c.notebook[:3]), c.id  # a table of that notebook (files carry its number)
        assert c.text and c.paper and c.section, c.id
    prefixes = {c.id.split("-")[0].rstrip("0123456789") for c in cl.CLAIMS}
    assert prefixes == {"P", "A9.", "A", "S", "B"}
    # the appendix findings the issue names, and each question beyond the papers
    assert {"A9.3-1", "A10-1", "A11-1"} <= set(ids)
    text = " ".join(c.text for c in cl.CLAIMS if c.source == "beyond the papers")
    for topic in ("SUR-IDF", "edit-local window", "Erratum", "stale", "agent traces", "sync"):
        assert topic.lower() in text.lower(), topic


def test_rows_not_computed_render_without_a_verdict(tmp_path):
    paths = cl.write_claims(tmp_path)
    assert [p.name for p in paths] == ["claims.md", "claims.csv"]
    md = paths[0].read_text()
    assert all(f"| {c.id} |" in md for c in cl.CLAIMS)
    table_rows = [line for line in md.splitlines() if line.startswith(("| P", "| A", "| S", "| B"))]
    assert len(table_rows) == len(cl.CLAIMS)
    assert all(line.split(" | ")[4].startswith(cl.NOT_COMPUTED) for line in table_rows)
    rows = list(csv.DictReader(io.StringIO(paths[1].read_text())))
    assert [r["id"] for r in rows] == [c.id for c in cl.CLAIMS]
    assert {r["verdict"] for r in rows} == {cl.NOT_COMPUTED} and {r["estimate"] for r in rows} == {""}
    assert f"Verdicts: 0 holds, 0 does not hold, 0 undecided at this size, {len(cl.CLAIMS)} not yet computed." in md


def _family_row(verdict, **extra):
    return {"comparison": "SUR 2% - Dense tokens 2%", "estimate": 12.5, "ci_low": 4.2, "ci_high": 20.8, "n": 96,
            "verdict": verdict, **extra}


@pytest.mark.parametrize("expect, word, verdict", [
    ("greater", "beats", "holds"), ("greater", "loses to", "does not hold"),
    ("greater", "not separated", "undecided at this size"), ("less", "loses to", "holds"),
    ("less", "beats", "does not hold"), ("equivalent", "equivalent", "holds"),
    ("equivalent", "beats", "does not hold"), ("equivalent", "not separated", "undecided at this size")])
def test_decide_maps_the_decision_words(expect, word, verdict):
    est = cl.decide(_family_row(word), expect=expect, unit="pp EM")
    assert est.verdict == verdict and (est.estimate, est.ci_low, est.ci_high, est.n) == (12.5, 4.2, 20.8, 96)


def test_the_estimate_shows_the_p_value_its_verdict_read():
    """An unadjusted interval that excludes 0 beside "undecided": the row says the Holm p (or the cluster count)
    the verdict was read from; clusters equal to n (no clustering) and a missing p add nothing."""
    holm = cl.decide(_family_row("not separated", p=0.0129, p_adj=0.1035, family_size=8, n_clusters=96),
                     expect="greater", unit="pp EM")
    assert (holm.p, holm.family_size, holm.n_clusters) == (0.1035, 8, None)
    assert cl.format_estimate(vars(holm)) == "+12.5 pp EM [+4.2, +20.8] (n 96; Holm p 0.1 over 8)"
    alone = cl.decide(_family_row("not separated", p_adj=0.5, family_size=1, n_clusters=2), expect="greater",
                      unit="pp EM")
    assert cl.format_estimate(vars(alone)) == "+12.5 pp EM [+4.2, +20.8] (n 96 in 2 clusters; p 0.5)"
    bare = cl.decide(_family_row("not separated", p_adj=float("nan")), expect="greater", unit="pp EM")
    assert bare.p is None and cl.format_estimate(vars(bare)) == "+12.5 pp EM [+4.2, +20.8] (n 96)"
    both = cl.all_of({"a": holm, "b": cl.decide(_family_row("beats", p_adj=0.01), expect="greater", unit="pp EM")})
    assert (both.p, both.family_size, both.verdict) == (0.1035, 8, "undecided at this size")


def test_decide_and_estimate_refuse_bad_input():
    with pytest.raises(ValueError, match="expect must be one of"):
        cl.decide(_family_row("beats"), expect="bigger", unit="pp")
    with pytest.raises(ValueError, match=r"row lacks \['ci_low'\]"):
        cl.decide({"estimate": 1, "ci_high": 2, "verdict": "beats"}, expect="greater", unit="pp")
    with pytest.raises(ValueError, match="verdict must be one of"):
        cl.Estimate(1.0, 0.0, 2.0, "pp", "beats")


def test_computed_rows_need_a_finished_notebook(tmp_path):
    undecided = cl.decide(_family_row("not separated", mde=9.3), expect="greater", unit="pp EM", note="paired")

    def missing_module(results):
        raise ImportError("No module named 'sur_lab.analysis.decisions'")

    claims = [cl.Claim("P1", "paper", "§5", "SUR beats Dense tokens.", "89.6 vs 7.3 %", "02_allocation_geometry",
                       "02_table12", compute=lambda results: undecided),
              cl.Claim("P2", "paper", "§4", "Another.", "x", "02_allocation_geometry", "02_table12",
                       compute=missing_module),
              cl.Claim("B1", "beyond the papers", "issue", "A question.", "-", "09_stale_facts", "09_summary",
                       compute=lambda results: undecided)]
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": 1, "notebooks": {
        "02_allocation_geometry": {"status": "finished"}, "09_stale_facts": {"status": "failed"}}}))
    rows = cl.claim_rows(tmp_path, claims)
    assert rows[0]["verdict"] == "undecided at this size" and rows[0]["mde"] == 9.3
    assert cl.format_estimate(rows[0]) == "+12.5 pp EM [+4.2, +20.8] (n 96)"
    assert cl.format_verdict(rows[0]) == "undecided at this size (smallest separable: 9.3 pp EM)"
    assert rows[1]["verdict"] == cl.NOT_COMPUTED and "ImportError" in rows[1]["note"]
    assert rows[2]["verdict"] == cl.NOT_COMPUTED
    assert rows[2]["note"] == "09_stale_facts has not finished in this release"
    md = cl.claims_markdown(rows, link=lambda stem: f"../{stem}/")
    assert "| P1 | SUR beats Dense tokens. <small>(§5)</small> | 89.6 vs 7.3 % | +12.5 pp EM [+4.2, +20.8] (n 96) | " \
           "undecided at this size (smallest separable: 9.3 pp EM) | [`02`](../02_allocation_geometry/) " \
           "`02_table12` |" in md
    assert md.index("## The paper") < md.index("## Beyond the papers")
    # how each computed verdict was read, under its section's table; a not-computed row's reason stays in its cell
    read = md.index("How each verdict was read:", md.index("## The paper"))
    assert md.index("| P2 |") < read < md.index("## Beyond the papers")
    assert "- **P1**: paired" in md[read:md.index("## Beyond the papers")]
    assert "- **P2**" not in md and "- **B1**" not in md and md.count("How each verdict was read:") == 1
    with pytest.raises(ValueError, match="repeat the ids"):
        cl.claim_rows(tmp_path, claims + claims[:1])


def test_paired_claim_goes_through_the_decisions_module(monkeypatch):
    seen = {}

    def paired_family(diffs, *, kind, margin=None, **options):
        seen.update(kind=kind, margin=margin, names=list(diffs))
        return [_family_row("beats", comparison=name) for name in diffs]

    monkeypatch.setattr(cl, "paired_family", paired_family)
    family = {"SUR 2% - Dense tokens 2%": [1, 0, 1], "SUR 2% - Shift": [1, 1, 0]}
    est = cl.paired_claim(family, comparison="SUR 2% - Shift", expect="greater", unit="pp EM")
    assert est.verdict == "holds" and seen == {"kind": "binary", "margin": None, "names": list(family)}
    with pytest.raises(KeyError, match="comparison 'SUR 5% - Shift' is not in the family"):
        cl.paired_claim(family, comparison="SUR 5% - Shift", expect="greater", unit="pp EM")


# ---------------------------------------------------------------------------------------------------------------------
# The compute functions, on small synthetic results folders whose tables have the notebooks' columns (the decided
# tables are written by the decisions module itself, as the notebooks write them; no notebook runs here)

TAG = "model-m_dtype-float32_device-cpu_n-48_seed-0"


def _results(tmp_path, tables, *, preset="default", finished=None):
    """A results folder: each table as ``tables/<name>_<TAG>.csv``, and a manifest where every notebook named by a
    table's prefix (or ``finished``) has finished at ``preset``."""
    (tmp_path / "tables").mkdir(exist_ok=True)
    for name, df in tables.items():
        df.to_csv(tmp_path / "tables" / f"{name}_{TAG}.csv", index=False)
    stems = {p.stem for p in notebooks("*") if any(n.startswith(p.stem[:3]) for n in tables)} | set(finished or ())
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": 1, "preset": preset, "notebooks": {
        s: {"status": "finished", "preset": preset} for s in stems}}))
    return tmp_path


def _decided(pairs, *, family, **kw):
    """A decided table as the notebooks save it: ``paired_family`` of ``pairs`` ((a, b) -> (a outcomes, b outcomes));
    binary unless the declared family says otherwise."""
    kind = None if hasattr(family, "kind") else "binary"
    return paired_family(pairs, kind=kind, family=family, n_boot=1000, seed=0, **kw)


def _row_of(results, claim_id):
    claim = next(c for c in cl.CLAIMS if c.id == claim_id)
    return cl.claim_row(claim, results)


ONES, ZEROS, HALF = np.ones(48), np.zeros(48), np.r_[np.zeros(24), np.ones(24)]
EM_LEAD = pd.DataFrame({"method": ["Shift", "Re-prefill", "SUR"], "Reference": [0.0, 100.0, np.nan],
                        "2%": [np.nan, np.nan, 100.0], "5%": [np.nan, np.nan, 100.0]})
RIVALS = "SUR against the references and the paper's allocators"


def test_table_path_reads_the_run_tagged_file_of_that_table_only(tmp_path):
    (tmp_path / "tables").mkdir()
    for name in (f"02_table12_{TAG}.csv", f"02_table12_concordance_{TAG}.csv"):
        pd.DataFrame({"x": [1]}).to_csv(tmp_path / "tables" / name, index=False)
    assert cl.table_path(tmp_path, "02_table12").name == f"02_table12_{TAG}.csv"
    assert cl.table_path(tmp_path, "02_table12_concordance").name == f"02_table12_concordance_{TAG}.csv"
    with pytest.raises(FileNotFoundError, match="no 02_table14 table"):
        cl.table_path(tmp_path, "02_table14")
    pd.DataFrame({"x": [2]}).to_csv(tmp_path / "tables" / "02_table12_model-other.csv", index=False)
    with pytest.raises(ValueError, match="02_table12: 2 runs' files"):
        cl.table_path(tmp_path, "02_table12")
    # the manifest's list of the notebook's outputs settles which run is the release's
    (tmp_path / "manifest.json").write_text(json.dumps({"notebooks": {"02_allocation_geometry": {
        "status": "finished", "outputs": {"tables/02_table12_model-other.csv": {}}}}}))
    assert cl.read_table(tmp_path, "02_table12")["x"].tolist() == [2]


def test_p1_reads_the_interval_against_80_pp(tmp_path):
    rivals = _decided({("SUR 2%", "Dense tokens 2%"): (ONES, ZEROS), ("SUR 2%", "Shift"): (ONES, HALF)},
                      family=RIVALS)
    results = _results(tmp_path, {"02_budget_table_em": EM_LEAD, "02_sur_vs_allocators": rivals})
    row = _row_of(results, "P1")
    dense = rivals.iloc[0]
    assert row["verdict"] == "holds" and row["unit"] == "pp EM" and row["n"] == 48
    assert (row["estimate"], row["ci_low"], row["ci_high"]) == (100.0, 100 * dense.ci_low, 100.0)
    # 7 units on one side separate at Holm's first step of a family of two (0.05 / 2)
    assert row["ci_low"] > 80 and math.isclose(row["mde"], 100 * 7 / 48)
    # P3 is the same table's SUR 2 % minus Shift: +50 pp, separated (holds: SUR above Shift)
    p3 = _row_of(results, "P3")
    assert p3["verdict"] == "holds" and p3["estimate"] == 50.0 and p3["ci_high"] < 80
    # +50 pp with its interval below 80 pp: "over 80 pp" does not hold, though SUR beats Dense tokens
    rivals2 = _decided({("SUR 2%", "Dense tokens 2%"): (ONES, HALF)}, family=RIVALS)
    results = _results(tmp_path, {"02_sur_vs_allocators": rivals2})
    row = _row_of(results, "P1")
    assert rivals2.iloc[0].verdict == "beats" and row["verdict"] == "does not hold" and row["estimate"] == 50.0


def test_niah_rows_follow_the_lead_endpoint_and_smoke_decides_nothing(tmp_path):
    lead = EM_LEAD.assign(Reference=[0.0, 10.0, np.nan])  # Re-prefill EM 10 %: the lead is agreement
    rivals = _decided({("SUR 2%", "Random semantic units 2%"): (ONES, ZEROS)}, family=RIVALS, decide=False)
    results = _results(tmp_path, {"02_budget_table_em": lead, "02_sur_vs_allocators": rivals}, preset="smoke")
    row = _row_of(results, "P5")
    assert row["unit"] == "pp agreement with Re-prefill" and row["verdict"] == "undecided at this size"
    assert row["estimate"] == 100.0 and "lead endpoint (agreement with Re-prefill)" in row["note"]
    assert _row_of(results, "P6")["verdict"] == cl.NOT_COMPUTED  # not in the table: no row, no verdict
    assert "has no row for 'SUR 2% vs Max-relevance contiguous 2%'" in _row_of(results, "P6")["note"]


def test_p2_is_an_exact_bound_on_sur_em(tmp_path):
    records = pd.DataFrame({"case_id": range(48), "method": "SUR", "budget_pct": 2.0, "em": [True] * 48})
    row = _row_of(_results(tmp_path, {"02_niah_records": records}), "P2")
    _, low, high = proportion_interval(48, 48)
    assert row["verdict"] == "holds" and (row["estimate"], row["ci_low"], row["ci_high"]) == (100.0, 100 * low, 100.0)
    records["em"] = [True] * 40 + [False] * 8  # 83 %, upper bound 92.5 % > 89.6 %: not shown either way
    row = _row_of(_results(tmp_path, {"02_niah_records": records}), "P2")
    assert row["verdict"] == "undecided at this size" and math.isclose(row["estimate"], 100 * 40 / 48)


def test_p8_is_all_of_the_derived_allocators_that_ran(tmp_path):
    rivals = _decided({("SUR 2%", "CacheBlend-Adapted 2%"): (ONES, ZEROS),
                       ("SUR 2%", "InfoFlow-Motivated 2%"): (HALF, HALF)}, family=RIVALS)
    row = _row_of(_results(tmp_path, {"02_budget_table_em": EM_LEAD, "02_sur_vs_allocators": rivals}), "P8")
    # InfoFlow is not separated (0 pp): the conjunction is undecided and shows that part
    assert row["verdict"] == "undecided at this size" and row["estimate"] == 0.0
    assert "shown: InfoFlow-Motivated" in row["note"]
    assert "Not run here: ProphetKV-Adapted, Cache-Craft-Adapted" in row["note"]
    rivals = _decided({("SUR 2%", "Dense tokens 2%"): (ONES, ZEROS)}, family=RIVALS)
    row = _row_of(_results(tmp_path, {"02_sur_vs_allocators": rivals}), "P8")
    # none ran (the default preset): undecided with no unit, never "not yet computed" and never a decided word
    assert row["verdict"] == "undecided at this size" and row["n"] == 0 and row["estimate"] is None
    assert row["note"].startswith("not run at this preset: notebook 02 compares none of ProphetKV-Adapted")
    assert cl.format_verdict(row) == "undecided at this size (0 units: this preset does not run it)"


def test_table14_and_ablation_rows(tmp_path):
    t14 = pd.DataFrame([{"length": "all", "context_len": np.nan, "family": "matched tokens (holdout roster)",
                         "budget_pct": 2.0, "allocator": "Dense tokens", "n": 24, "unit": "pp", "em_delta": 25.0,
                         "em_delta_low": 6.5, "em_delta_high": 41.0, "em_p_adj": 0.01, "em_verdict": "beats",
                         "em_delta_mde": 33.3}])
    abl = _decided({("Fixed blocks 2%", "SUR 2%"): (ZEROS, ONES), ("Fixed blocks 5%", "SUR 5%"): (ZEROS, ONES),
                    ("Multiple local windows 2%", "SUR 2%"): (HALF, ONES),
                    ("Multiple local windows 5%", "SUR 5%"): (ONES, ONES)},
                   family="SUR's design factors").assign(metric="em")
    results = _results(tmp_path, {"02_budget_table_em": EM_LEAD, "02_table14": t14, "02_ablation": abl})
    row = _row_of(results, "A9.3-1")
    assert (row["estimate"], row["ci_low"], row["ci_high"], row["n"], row["mde"]) == (25.0, 6.5, 41.0, 24, 33.3)
    assert row["verdict"] == "holds"
    row = _row_of(results, "A9.3-4")  # Multiple local windows ties SUR at 5 %: the conjunction is undecided
    assert row["verdict"] == "undecided at this size" and "shown: Multiple local windows 5% vs SUR 5%" in row["note"]
    assert row["estimate"] == 0.0
    assert _row_of(results, "A9.3-3")["verdict"] == "undecided at this size"  # no SUR variant ran
    assert _row_of(results, "A9.3-3")["n"] == 0
    assert _row_of(results, "A9.3-3")["note"] == (f"not run at this preset: the claim's joint arm ({cl.JOINT_ARM} 5%) "
                                                  "did not run (the paper preset runs it)")


def test_design_tie_reads_the_joint_arm_only(tmp_path):
    """A9.3-3 is about the joint configuration: single-factor rows are context in the note, never the verdict (the
    mean-aggregation factor separated from SUR by +50 pp does not make the joint tie 'not hold')."""
    factor = _decided({("SUR[aggregation=mean] 5%", "SUR 5%"): (ONES, HALF)}, family="SUR's design factors")
    results = _results(tmp_path, {"02_budget_table_em": EM_LEAD, "02_ablation": factor.assign(metric="em")})
    row = _row_of(results, "A9.3-3")
    assert row["verdict"] == "undecided at this size" and row["estimate"] is None and row["n"] == 0
    assert row["note"].startswith(f"not run at this preset: the claim's joint arm ({cl.JOINT_ARM} 5%) did not run "
                                  "(the paper preset runs it); as context, each factor alone against SUR at 5 % (no "
                                  "verdict: the claim is about both together, with allowance_base=prompt as the "
                                  "paper's configuration): SUR[aggregation=mean] 5% vs SUR 5% +50 pp EM [")
    assert "hold" not in row["note"]  # the context carries no verdict word
    joint = _decided({("SUR[aggregation=mean] 5%", "SUR 5%"): (ONES, HALF),
                      (f"{cl.JOINT_ARM} 5%", "SUR 5%"): (ONES, ONES)}, family="SUR's design factors")
    results = _results(tmp_path, {"02_budget_table_em": EM_LEAD, "02_ablation": joint.assign(metric="em")})
    row = _row_of(results, "A9.3-3")  # no margin is declared for the ablation family: a tie is never shown
    assert row["verdict"] == "undecided at this size" and row["estimate"] == 0.0 and row["n"] == 48
    assert "SUR[aggregation=mean] 5%" not in row["note"]


def test_natural_qa_rows(tmp_path):
    from sur_lab.studies import natural_qa as qa

    rng = np.random.default_rng(0)
    t_sur, t_re = rng.uniform(1, 2, 24), rng.uniform(3, 4, 24)
    decided = pd.concat([
        _decided({("SUR 5%", "Shift"): (ONES, HALF)}, family=qa.PRIMARY),
        _decided({("SUR 2%", "Re-prefill"): (HALF, ONES), ("SUR 5%", "Re-prefill"): (ONES, ONES)},
                 family=qa.REFERENCE_FAMILY),
        _decided({("SUR 5%", "Re-prefill"): (t_sur, t_re)}, family=qa.LATENCY)], ignore_index=True)
    t7 = pd.DataFrame({"condition": ["SUR 5%", "Re-prefill"], "em_pct": [40.0, 45.0]})
    results = _results(tmp_path, {"03_decisions": decided, "03_table7_quality_latency": t7})
    p10 = _row_of(results, "P10")
    assert p10["verdict"] == "holds" and p10["estimate"] == 50.0 and "tested alone" in p10["note"]
    assert _row_of(results, "P11")["verdict"] == "holds"  # SUR 2 % below Re-prefill, separated
    p9 = _row_of(results, "P9")  # identical outcomes, but no declared margin: never shown equivalent
    assert p9["verdict"] == "undecided at this size" and p9["estimate"] == 0.0
    p12 = _row_of(results, "P12")
    lat = decided[decided.family == qa.LATENCY.name].iloc[0]
    assert p12["unit"] == "x" and p12["verdict"] == "holds" and p12["ci_low"] == lat.ci_low > 1
    assert math.isclose(p12["estimate"], lat.estimate)
    p13 = _row_of(results, "P13")  # no Replay at the default preset: undecided, with no unit
    assert p13["verdict"] == "undecided at this size" and p13["n"] == 0 and p13["estimate"] is None
    assert p13["note"].startswith("not run at this preset: notebook 03 ran no Replay at this preset")
    t7["em_pct"] = [5.0, 10.0]  # Re-prefill's EM below the lead threshold: agreement leads, no Re-prefill row
    results = _results(tmp_path, {"03_table7_quality_latency": t7})
    assert "lead endpoint is agreement" in _row_of(results, "P9")["note"]


def _t15_row(condition, hypothesis, estimate, low, high, *, p=0.5, p_adj=0.5, tost=(np.nan, np.nan), n=40):
    """A row of ``08_table15`` in the one paired-difference schema; ``estimate``, ``low``, ``high`` and ``tost`` in
    the printed unit (pp for EM: the decision columns hold fractions)."""
    k = 100.0 if hypothesis.startswith("EM") else 1.0
    return {"condition": condition, "hypothesis": hypothesis, "kind": "binary" if k == 100.0 else "continuous",
            "estimate": estimate / k, "ci_low": low / k, "ci_high": high / k, "tost_low": tost[0] / k,
            "tost_high": tost[1] / k, "p": p, "p_adj": p_adj, "n": n, "n_clusters": n, "delta": estimate,
            "delta_low": low, "delta_high": high, "unit": "pp" if k == 100.0 else "nats"}


def test_evidence_location_rows(tmp_path):
    t15 = pd.DataFrame([
        _t15_row("Replay", "NLL side", -0.01, -0.05, 0.03, tost=(-0.04, 0.02)),
        _t15_row("Replay", "EM side", 6.0, 3.0, 9.0, p=0.0004, p_adj=0.002),
        _t15_row("Replay", "NLL tail", -0.03, -0.07, 0.004),
        _t15_row("Replay", "NLL interaction", 0.01, -0.02, 0.04),
        _t15_row("Replay", "EM tail", 0.5, -1.6, 2.6),
        _t15_row("Replay", "EM interaction", -1.2, -4.8, 2.2),
        _t15_row("Fixed slot", "NLL side", -0.2, -0.3, -0.1, p=0.001, p_adj=0.004, tost=(-0.28, -0.12))])
    findings = pd.DataFrame([{"finding": "fixed-slot refresh carries the side effect", "rule": "r",
                              "verdict": "not carried", "evidence": "TV: ...", "reproduced": False}])
    results = _results(tmp_path, {"08_table15": t15, "08_findings": findings})
    a1 = _row_of(results, "A10-1")  # 90 % interval inside ±0.1 nats: equivalent
    assert a1["verdict"] == "holds"
    assert (a1["estimate"], a1["ci_low"], a1["ci_high"], a1["n"]) == (-0.01, -0.05, 0.03, 40)
    assert a1["unit"] == "nats"
    a2 = _row_of(results, "A10-2")
    assert a2["verdict"] == "holds" and a2["unit"] == "pp EM" and a2["estimate"] == 6.0
    assert "too few for an interval" not in a2["note"]
    one = t15.copy()
    # one source: no interval, and its test cannot reach significance (p 1)
    one.loc[one.hypothesis == "EM side", ["n", "n_clusters", "delta_low", "delta_high", "p", "p_adj"]] = [
        1, 1, np.nan, np.nan, 1.0, 1.0]
    a2_one = _row_of(_results(tmp_path, {"08_table15": one, "08_findings": findings}), "A10-2")
    assert a2_one["verdict"] == "undecided at this size" and a2_one["n"] == 1
    assert a2_one["note"].endswith("the EM stratum (the sources Re-prefill answers) held one source, too few for an "
                                   "interval")
    a3 = _row_of(results, "A10-3")  # no margin for these: never shown null
    assert a3["verdict"] == "undecided at this size" and a3["note"].startswith("all of 4 must hold")
    a4 = _row_of(results, "A10-4")
    assert a4["verdict"] == "does not hold" and a4["estimate"] is None and a4["note"] == "not carried: TV: ..."
    a5 = _row_of(results, "A10-5")  # separated below 0: the null does not hold
    assert a5["verdict"] == "does not hold" and a5["estimate"] == -0.2
    smoke = _results(tmp_path, {"08_table15": t15}, preset="smoke")
    assert _row_of(smoke, "A10-1")["verdict"] == "undecided at this size"


def test_stale_facts_rows(tmp_path):
    from sur_lab.studies import stale_facts as sf

    em = _decided({("Edit-local window 5%", "SUR 5%"): (ONES, HALF), ("Erratum", "SUR 5%"): (ZEROS, ONES)},
                  family=sf.EM_FAMILY).assign(metric="em")
    stale = _decided({("SUR 5%", "Shift"): (ZEROS, ONES)}, family=sf.STALE_FAMILY).assign(metric="stale")
    results = _results(tmp_path, {"09_paired_differences": pd.concat([em, stale], ignore_index=True)})
    assert _row_of(results, "B2")["verdict"] == "holds" and _row_of(results, "B2")["estimate"] == 50.0
    assert _row_of(results, "B4")["verdict"] == "does not hold" and _row_of(results, "B4")["estimate"] == -100.0
    assert _row_of(results, "B3")["verdict"] == cl.NOT_COMPUTED
    b5 = _row_of(results, "B5")  # 100 pp fewer stale answers: lower is better, so SUR "beats" Shift
    assert b5["verdict"] == "holds" and b5["estimate"] == -100.0 and b5["unit"] == "pp stale"


def test_every_claim_renders_on_empty_and_on_finished_folders(tmp_path):
    """A finished notebook with no tables: each row that reads a table says why it is not computed; the rows whose
    comparison the default preset never runs (no table needed to know it) are undecided with no unit; nothing
    crashes."""
    finished = {p.stem for p in notebooks("*")}
    results = _results(tmp_path, {}, finished=finished)
    rows = cl.claim_rows(results)
    not_run = {r["id"] for r in rows if r["verdict"] != cl.NOT_COMPUTED}
    assert not_run == {"A9.3-2"}
    assert all(r["verdict"] == cl.NOT_COMPUTED and r["note"] for r in rows if r["id"] not in not_run)
    assert all(r["verdict"] == "undecided at this size" and r["n"] == 0 and r["note"].startswith(
        "not run at this preset: ") for r in rows if r["id"] in not_run)
    notes = {r["id"]: r["note"] for r in rows}
    assert notes["P1"].startswith("cannot compute yet: FileNotFoundError: results/tables has no 02_budget_table_em")
    assert notes["P4"].startswith("cannot compute yet: FileNotFoundError: results/tables has no 02_niah_records")
    md = cl.claims_markdown(rows)
    assert all(f"| {c.id} |" in md for c in cl.CLAIMS)


def test_threshold_claim_and_all_of():
    row = _decided({("a", "b"): (ONES, ZEROS)}, family="f").iloc[0].to_dict()
    assert cl.threshold_claim(row, 0.8, expect="greater", unit="pp").verdict == "holds"
    assert cl.threshold_claim(row, 0.95, expect="greater", unit="pp").verdict == "undecided at this size"
    # an interval wholly below the threshold does not hold, whatever the p against 0 (P1: [-10, +6] pp against
    # "over 80 pp", Holm p 1); just below with an upper end above it stays undecided
    tie = _decided({("a", "b"): (HALF, HALF[::-1])}, family="f").iloc[0].to_dict()
    assert tie["p_adj"] > 0.05 and tie["ci_high"] < 0.8
    assert cl.threshold_claim(tie, 0.8, expect="greater", unit="pp").verdict == "does not hold"
    assert cl.threshold_claim(tie, tie["ci_high"] + 1e-9, expect="greater", unit="pp").verdict == "does not hold"
    assert cl.threshold_claim(tie, tie["ci_high"] - 1e-9, expect="greater", unit="pp").verdict == \
        "undecided at this size"
    assert cl.threshold_claim(tie, 0.8, expect="greater", unit="pp", decide_=False).verdict == "undecided at this size"
    est = cl.threshold_claim(row, 0.8, expect="greater", unit="pp", decide_=False)
    assert est.verdict == "undecided at this size" and est.estimate == 100.0
    holds = cl.Estimate(1.0, 0.5, 1.5, "pp", "holds")
    fails = cl.Estimate(-1.0, -1.5, -0.5, "pp", "does not hold")
    both = cl.all_of({"x": holds, "y": fails})
    assert both.verdict == "does not hold" and both.estimate == -1.0 and "shown: y" in both.note
    assert cl.all_of({"x": holds}).verdict == "holds"
    with pytest.raises(cl.NotComputed, match="none of the comparisons ran"):
        cl.all_of({})


def test_an_empty_em_stratum_is_not_computed(tmp_path):
    t15 = pd.DataFrame([_t15_row("Replay", "EM side", np.nan, np.nan, np.nan, p=np.nan, p_adj=np.nan, n=0),
                        _t15_row("Replay", "EM tail", np.nan, np.nan, np.nan, p=np.nan, p_adj=np.nan, n=0),
                        _t15_row("Replay", "NLL tail", -0.03, -0.07, 0.004),
                        _t15_row("Replay", "NLL interaction", 0.01, -0.02, 0.04)])
    results = _results(tmp_path, {"08_table15": t15})
    a2 = _row_of(results, "A10-2")
    assert a2["verdict"] == cl.NOT_COMPUTED and "the EM stratum" in a2["note"] and "is empty" in a2["note"]
    a3 = _row_of(results, "A10-3")  # the two NLL parts are decided; the EM tail has no source, EM interaction no row
    assert a3["verdict"] == "undecided at this size" and a3["note"].startswith("all of 2 must hold")
    assert "Not run here: Replay's EM tail contrast has no source" in a3["note"]


def test_agent_trace_rows_read_the_decided_table_notebook_10_saved(tmp_path):
    from sur_lab.studies import agent_traces as at

    rows = []
    for trace in range(12):
        for turn in range(4):
            region = "first half" if turn % 2 else "append"
            kind = "new" if turn == 0 else "combine"
            for path, ms in (("sync 5%", 10.0 + trace), (at.PREFIX, 40.0 + trace), (at.REFERENCE, 50.0)):
                rows.append({"trace": trace, "turn": turn, "path": path, "ttft_ms": ms if region != "append" else 5.0,
                             "agree": True, "em": True, "region": region, "kind": kind})
    decided = at.primary_table(pd.DataFrame(rows), sync="sync 5%", seed=0)  # what notebook 10 saves
    results = _results(tmp_path, {"10_agent_traces_decided": decided})
    b7 = _row_of(results, "B7")
    assert b7["verdict"] == "holds" and b7["unit"] == "x" and b7["ci_low"] > 1
    region = decided[decided.comparison == "sync 5% (first half) vs prefix reuse (first half)"].iloc[0]
    assert (b7["estimate"], b7["ci_low"], b7["ci_high"]) == (region.estimate, region.ci_low, region.ci_high)
    assert b7["table"] == "10_agent_traces_decided"
    b6 = _row_of(results, "B6")  # every answer agrees: 0 pp, and 24 units do not fit a ±5 pp 90 % interval
    agree = decided[decided.family == at.AGREEMENT_FAMILY.name].iloc[0]
    assert b6["estimate"] == 0.0 and b6["unit"] == "pp agreement with re-prefill"
    assert b6["verdict"] == {"equivalent": "holds"}.get(agree.verdict, "undecided at this size")
    # The row follows the saved table, not a recomputation: what the notebook decided is what the claim reports.
    moved = decided.copy()
    moved.loc[moved.comparison == region.comparison, ["estimate", "ci_low", "ci_high", "verdict"]] = [
        0.7, 0.5, 0.9, "loses to"]
    b7_moved = _row_of(_results(tmp_path, {"10_agent_traces_decided": moved}), "B7")
    assert b7_moved["verdict"] == "does not hold" and (b7_moved["estimate"], b7_moved["ci_low"]) == (0.7, 0.5)
    no_sync = decided[~decided["a"].str.startswith("sync ")]
    assert _row_of(_results(tmp_path, {"10_agent_traces_decided": no_sync}), "B6")["note"] == (
        "10_agent_traces_decided has no budgeted sync path")


def test_noprefix_rows(tmp_path):
    endpoints = pd.DataFrame([
        {"workload": w, "label": label, "protocol": proto, "n": n, "preservation": pres}
        for w, n in (("Noise4", 12), ("Noise16", 12))
        for label, proto, pres in (("Prefix composition", "forward", 0.5), ("Prefix composition", "donor", 1.0),
                                   ("Suffix K2 · risk", "forward", 1.0), ("Doc K2 · oracle", "forward", 11 / 12))])
    ledger = pd.DataFrame([
        {"experiment": "Downstream window w4 vs suffix K1 (risk, same start)", "key_result": "w4 ... ",
         "verdict": "did not", "criterion": "c"},
        {"experiment": "Linked intervals vs suffix (oracle)", "key_result": "k", "verdict": "worked", "criterion": "c"},
        {"experiment": "Adaptive suffix 50% vs suffix K2 (risk)", "key_result": "k", "verdict": "not separated",
         "criterion": "c"}])
    rule = pd.DataFrame([{"workload": "Noise4", "serve": "full prefill", "label": "Full prefill", "reason": "r4"},
                         {"workload": "Noise16", "serve": "repair", "label": "Suffix K1 · risk", "reason": "r16"}])
    results = _results(tmp_path, {"06_noprefix_endpoints": endpoints, "06_noprefix_design_ledger": ledger,
                                  "06_noprefix_operating_rule": rule})
    s1 = _row_of(results, "S1")  # 12 of 24 preserved: upper bound 71 % < 95 %, so composition loses answers
    _, low, high = proportion_interval(12, 24)
    assert s1["verdict"] == "holds" and (s1["estimate"], s1["ci_low"], s1["ci_high"], s1["n"]) == (50.0, 100 * low,
                                                                                                   100 * high, 24)
    s2 = _row_of(results, "S2")  # 24 of 24: lower bound 86 % < 95 %, not shown at this size
    assert s2["verdict"] == "undecided at this size" and s2["estimate"] == 100.0
    assert _row_of(results, "S3")["verdict"] == "undecided at this size"  # 22 of 24: neither bound decides
    assert [_row_of(results, i)["verdict"] for i in ("S4", "S5", "S6")] == [
        "holds", "does not hold", "undecided at this size"]
    assert _row_of(results, "S4")["note"] == "ledger: did not (c): w4 ... "
    s9 = _row_of(results, "S9")
    assert s9["verdict"] == "does not hold" and s9["n"] == 2 and "Noise16: repair (r16)" in s9["note"]
    rule["serve"] = "full prefill"
    results = _results(tmp_path, {"06_noprefix_operating_rule": rule})
    assert _row_of(results, "S9")["verdict"] == "undecided at this size"
    # S7 at these sizes: composition keeps 12 of 24 at <= 4 documents, so "exact up to four documents" fails
    s7 = _row_of(results, "S7")
    assert s7["verdict"] == "does not hold" and s7["n"] == 12 and "all of 3 must hold" in s7["note"]
    assert "composition, 16 documents" in s7["note"] and "suffix K2 · risk, 16 documents" in s7["note"]


def test_s7_holds_when_all_three_parts_do(tmp_path):
    """Composition reaches 95 % on the four-document workloads (100 of 100: exact lower bound 96.4 %), falls short at
    sixteen (6 of 12: upper bound 79 %), where suffix K2 reaches it (100 of 100)."""
    endpoints = pd.DataFrame([
        {"workload": "HotpotQA·4", "label": "Prefix composition", "protocol": "forward", "n": 100, "preservation": 1.0},
        {"workload": "HotpotQA·16", "label": "Prefix composition", "protocol": "forward", "n": 12, "preservation": 0.5},
        {"workload": "HotpotQA·16", "label": "Suffix K2 · risk", "protocol": "forward", "n": 100, "preservation": 1.0},
        {"workload": "HotpotQA·64", "label": "Prefix composition", "protocol": "forward", "n": 2, "preservation": 0.0}])
    results = _results(tmp_path, {"06_noprefix_endpoints": endpoints})
    s7 = _row_of(results, "S7")
    assert s7["verdict"] == "holds" and s7["n"] == 100  # the 64-document workload enters no part
    endpoints = endpoints[endpoints["workload"] != "HotpotQA·16"]
    results = _results(tmp_path, {"06_noprefix_endpoints": endpoints})
    assert _row_of(results, "S7")["verdict"] == cl.NOT_COMPUTED
    assert "of 16 documents" in _row_of(results, "S7")["note"]


def _timings(ms: dict, reps: int = 5) -> pd.DataFrame:
    """``04_timings`` as notebook 04 saves it: one row per (context length, R, executor, repeat); ``ms`` maps
    (executor, R) to its time, spread by +-1 % over the repeats and twice as long at the longer context."""
    rng = np.random.default_rng(0)
    return pd.DataFrame([{"context_len": n, "num_intervals": r, "executor": e, "rep": k, "order": 0,
                          "ms": t * (n / 2040) * (1 + 0.01 * rng.uniform(-1, 1)), "pairs": 1}
                         for n in (2040, 4080) for (e, r), t in ms.items() for k in range(reps)])


TABLE18 = {("sequential", 16): 1000.0, ("one-shot", 16): 200.0, ("packed-inplace", 16): 100.0,
           ("direct-sequential", 1): 90.0, ("packed-inplace", 1): 100.0}


def test_table18_rows_decide_the_cpu_timings_as_one_family(tmp_path):
    timings = _timings(TABLE18)
    results = _results(tmp_path, {"04_timings": timings})
    p15, p16, p17 = (_row_of(results, i) for i in ("P15", "P16", "P17"))
    # P15: interval-wise over packed at R = 16, the geometric mean of the ten paired ratios
    at16 = timings[timings.num_intervals == 16].pivot_table(index=["context_len", "rep"], columns="executor",
                                                            values="ms")
    ratio = math.exp(np.log(at16["sequential"] / at16["packed-inplace"]).mean())
    assert p15["verdict"] == "holds" and p15["n"] == 10 and p15["estimate"] == pytest.approx(ratio, rel=1e-12)
    assert p15["ci_low"] > cl.P15_MUCH_FASTER and "CPU analogue" in p15["note"]
    # ten units: the sign-flip test's smallest p is 2 / 2**10, Holm over the family's four comparisons
    assert p15["p"] == pytest.approx(4 * 2 / 2 ** 10) and p15["family_size"] == 4
    assert p16["verdict"] == "holds" and "packed over one-shot" in p16["note"]
    assert p17["verdict"] == "holds" and p17["estimate"] == pytest.approx(100 / 90, rel=0.03)
    # packing faster than direct-cache sequential at R = 1: P17 does not hold; packed only 1.5x faster than
    # interval-wise, its whole interval below 2x: P15 does not hold either
    slow = {**TABLE18, ("direct-sequential", 1): 110.0, ("sequential", 16): 150.0, ("one-shot", 16): 140.0}
    results = _results(tmp_path, {"04_timings": _timings(slow)})
    assert _row_of(results, "P17")["verdict"] == "does not hold"
    p15 = _row_of(results, "P15")
    assert p15["verdict"] == "does not hold" and 1 < p15["ci_low"] < p15["ci_high"] < cl.P15_MUCH_FASTER
    # the notebook's target_executor names the packed executor
    timings = _timings({(("packed-cpp" if e == "packed-inplace" else e), r): t for (e, r), t in slow.items()})
    results = _results(tmp_path, {"04_timings": timings})
    assert _row_of(results, "P17")["verdict"] == cl.NOT_COMPUTED
    manifest = json.loads((results / "manifest.json").read_text())
    manifest["notebooks"]["04_packed_refresh_benchmark"]["parameters"] = {"target_executor": "packed-cpp"}
    (results / "manifest.json").write_text(json.dumps(manifest))
    assert _row_of(results, "P17")["verdict"] == "does not hold"



def _donor_runs(donor_kept: int, n: int = 16) -> pd.DataFrame:
    """Per-request rows of suffix K1 (risk): forwarding preserves half of ``n`` requests, donor-copy the first
    ``donor_kept`` (each request its own source)."""
    rows = [{"label": "Suffix K1 · risk", "protocol": proto, "case_id": f"hotpotqa/s{i}/W", "dataset": "hotpotqa",
             "source_id": f"s{i}", "preserved": kept}
            for i in range(n) for proto, kept in (("forward", i < n // 2), ("donor", i < donor_kept))]
    return pd.DataFrame(rows)


def _endpoints(*workloads):
    """``06_noprefix_endpoints`` with one forwarded suffix K1 row per workload name."""
    return pd.DataFrame({"workload": list(workloads), "label": "Suffix K1 · risk", "protocol": "forward", "n": 8,
                         "preservation": 1.0})


def test_s10_reads_the_donor_proxy_row_of_the_saved_decided_table(tmp_path):
    # Donor-copy preserves 16 of 16, forwarding 8 of 16: +50 pp, 8 discordant pairs all one way (sign p 0.0078), so
    # donor-copy overstates forwarding: S10 holds, with the table's numbers in pp (a run with Noise64).
    noise64 = _endpoints("HotpotQA·4", "Noise64")
    table = decided_table(_donor_runs(16), seed=0)
    s10 = _row_of(_results(tmp_path, {"06_noprefix_decided": table, "06_noprefix_endpoints": noise64}), "S10")
    assert s10["verdict"] == "holds" and s10["estimate"] == pytest.approx(50.0) and s10["n"] == 16
    assert s10["ci_low"] == pytest.approx(table.iloc[0].delta_low) and s10["ci_high"] == pytest.approx(
        table.iloc[0].delta_high)
    assert s10["note"].endswith("8 of 16 request pairs discordant; pooled over the workloads of 4, 64 documents")
    # Donor-copy preserves exactly forwarding's requests: no discordant pair, undecided (never "holds" on a tie).
    same = _row_of(_results(tmp_path, {"06_noprefix_decided": decided_table(_donor_runs(8), seed=0),
                                       "06_noprefix_endpoints": noise64}), "S10")
    assert same["verdict"] == "undecided at this size" and same["estimate"] == 0.0
    assert "0 of 16 request pairs discordant" in same["note"]
    # Donor-copy below forwarding (0 of 16 against 8): the claim does not hold.
    below = _row_of(_results(tmp_path, {"06_noprefix_decided": decided_table(_donor_runs(0), seed=0),
                                        "06_noprefix_endpoints": noise64}), "S10")
    assert below["verdict"] == "does not hold"
    # Without a long composition (the default's 4 and 16 documents) the claim's workload was not run: undecided with
    # no unit, whatever the pooled primary says, which the note gives as context.
    short = _row_of(_results(tmp_path, {"06_noprefix_decided": table,
                                        "06_noprefix_endpoints": _endpoints("HotpotQA·4", "HotpotQA·16")}), "S10")
    assert short["verdict"] == "undecided at this size" and short["n"] == 0 and short["estimate"] is None
    assert short["note"].startswith("not run at this preset: the claim is about a long composition (Noise64, "
                                    "SAFE-KV's Table 20), and this run's largest workload has 16 documents")
    assert "as context, notebook 06's primary: +50 pp preservation [" in short["note"]


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 05 (execution paths): A11-1..3 rebuilt per cell from the saved decodes


def _digest(text):
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def _paths_records(n_cells=16, *, dtype="bfloat16", logits_differ=None, argmax_flips=None, seq_flips=None,
                   nll_within=None, nll_cross=None):
    """Decodes with the columns of ``execution_paths.run`` as notebook 05 saves them (``token_ids`` as text), one cell
    per case: ``shared`` and ``reprefill`` repeat one decode; ``replay`` has its own first-logit bytes where
    ``logits_differ[i]``, its first ``argmax_flips[i]`` repeats another argmax (and so other bytes) and its first
    ``seq_flips[i]`` repeats another sequence. Re-prefill's NLLs are ``(1, 1 + w, 1)`` (median within |dNLL| ``w``),
    Replay's ``1 + c`` (median of the nine cross |dNLL|: ``c``)."""
    rows = []
    for i in range(n_cells):
        differ = True if logits_differ is None else logits_differ[i]
        flips = 0 if argmax_flips is None else argmax_flips[i]
        seqs = 0 if seq_flips is None else seq_flips[i]
        w = 0.0 if nll_within is None else nll_within[i]
        c = 0.05 if nll_cross is None else nll_cross[i]
        base = {"model": "m", "dtype": dtype, "device": "cpu", "case_id": f"{dtype}-{i:02d}", "dataset": "hotpotqa",
                "source_id": f"s{i // 4}", "cell": f"g{i % 4}", "text": "x", "finished": True}
        for cond in ("shared", "reprefill", "replay"):
            for r in range(3):
                ids, top, logits, nll = [1, 2], 5, _digest(f"{i}-reprefill"), 1.0
                if cond == "reprefill":
                    nll = 1.0 + (w if r == 1 else 0.0)
                if cond == "replay":
                    nll = 1.0 + c
                    logits = _digest(f"{i}-replay") if differ or r < flips else logits
                    top = 6 if r < flips else 5
                    if r < flips:
                        logits = _digest(f"{i}-replay-{r}")
                    ids = [1, 3] if r < seqs else ids
                rows.append({**base, "condition": cond, "repeat": r, "token_ids": str(ids), "argmax": top,
                             "logits_sha256": logits, "gold_nll": nll})
    return pd.DataFrame(rows)


def test_a11_rows_hold_on_bfloat16_cells_whose_logits_always_differ(tmp_path):
    from sur_lab.studies.execution_paths import cell_table

    flips, seqs = [1, 1] + [0] * 14, [1, 2, 1] + [0] * 13
    cross = 0.02 + 0.01 * np.arange(16)
    bf16 = _paths_records(argmax_flips=flips, seq_flips=seqs, nll_cross=cross)
    fp32 = _paths_records(dtype="float32", logits_differ=[False] * 12 + [True] * 4)  # the note's, decides nothing
    results = _results(tmp_path, {"05_execution_paths": pd.concat([bf16, fp32], ignore_index=True)})
    a1 = _row_of(results, "A11-1")  # 16 of 16 differ: lower bound 0.025 ** (1 / 16) = 79.4 % >= 75 %
    _, low, _ = proportion_interval(16, 16)
    assert a1["verdict"] == "holds" and (a1["estimate"], a1["ci_low"], a1["ci_high"], a1["n"]) == (100.0, 100 * low,
                                                                                                   100.0, 16)
    assert math.isclose(low, 0.025 ** (1 / 16)) and a1["unit"] == "% of cells" and a1["table"] == "05_execution_paths"
    assert "16 of 16 cells" in a1["note"] and "float32: 4 of 16 cells differ (not decided)" in a1["note"]
    # A11-2: exact-logit disagreement 1 in every cell; argmax 3/9 in two cells, sequence 3/9 or 6/9 in three
    a2 = _row_of(results, "A11-2")
    ct = cell_table(bf16.assign(token_ids=bf16.token_ids.map(json.loads)))
    assert ct["cross_exact_logits"].eq(0).all() and ct["cross_argmax"].tolist()[:3] == [6 / 9, 6 / 9, 1.0]
    family = {("exact logits", out): (1 - ct["cross_exact_logits"].to_numpy(), 1 - ct[f"cross_{out}"].to_numpy())
              for out in ("argmax", "sequence")}
    decided = paired_family(family, family=cl.A11_GAP)
    assert list(decided.verdict) == ["beats", "beats"]
    seq = decided.iloc[1]  # the weaker part on a tie of verdicts is the first: argmax
    arg = decided.iloc[0]
    assert a2["verdict"] == "holds" and a2["unit"] == "pp cross-path disagreement" and a2["n"] == 16
    assert math.isclose(a2["estimate"], 100 * (1 - 2 * (3 / 9) / 16)) and math.isclose(a2["estimate"],
                                                                                         100 * arg.estimate)
    assert (a2["ci_low"], a2["ci_high"]) == (100 * arg.ci_low, 100 * arg.ci_high) and a2["ci_low"] > 50
    assert math.isclose(seq.estimate, 1 - (3 / 9 + 6 / 9 + 3 / 9) / 16)
    assert a2["note"].startswith("all of 2 must hold; shown: m, bfloat16 on cpu, argmax")
    # A11-3: within-Re-prefill |dNLL| 0, cross-path 0.02 .. 0.17 nats
    a3 = _row_of(results, "A11-3")
    assert np.allclose(ct["nll_cross"], cross) and ct["nll_within"].eq(0).all()
    nll = paired_family({("cross-path |dNLL|", "within-Re-prefill |dNLL|"): (ct["nll_cross"], ct["nll_within"])},
                        family=cl.A11_NLL).iloc[0]
    assert a3["verdict"] == "holds" and a3["unit"] == "nats" and a3["n"] == 16
    assert math.isclose(a3["estimate"], cross.mean()) and (a3["ci_low"], a3["ci_high"]) == (nll.ci_low, nll.ci_high)
    assert 0 < a3["ci_low"] < cross.mean() < a3["ci_high"]


def test_a11_rows_do_not_hold_when_the_paths_agree_or_argmax_disagrees_as_often(tmp_path):
    # logit bytes equal in 12 of 16 cells; Re-prefill repeats disagree in NLL more than the paths do
    recs = _paths_records(logits_differ=[True] * 4 + [False] * 12, nll_within=np.full(16, 0.1),
                          nll_cross=np.linspace(0.0, 0.05, 16))
    results = _results(tmp_path, {"05_execution_paths": recs})
    a1 = _row_of(results, "A11-1")  # 4 of 16: upper bound 52 % < 75 %
    _, low, high = proportion_interval(4, 16)
    assert a1["verdict"] == "does not hold" and (a1["estimate"], a1["ci_low"], a1["ci_high"]) == (25.0, 100 * low,
                                                                                                  100 * high)
    a3 = _row_of(results, "A11-3")  # cross minus within is negative in every cell: separated below 0
    assert a3["verdict"] == "does not hold" and math.isclose(a3["estimate"], 0.025 - 0.1) and a3["ci_high"] < 0
    # exact-logit disagreement 1 in only four cells, argmax 0: +25 pp, four units cannot separate (sign-flip p 0.125)
    a2 = _row_of(results, "A11-2")
    assert a2["verdict"] == "undecided at this size" and math.isclose(a2["estimate"], 25.0)
    # every replay decode but one takes another argmax: argmax disagreement 6/9 against exact-logit 1, a gap of 1/3
    recs = _paths_records(argmax_flips=[2] * 16, seq_flips=[2] * 16)
    a2 = _row_of(_results(tmp_path, {"05_execution_paths": recs}), "A11-2")
    assert a2["verdict"] == "does not hold" and math.isclose(a2["estimate"], 100 / 3)
    assert math.isnan(a2["ci_low"])  # every cell's gap the same: no bootstrap interval, the test and estimate decide


def test_a11_rows_scope_and_plumbing(tmp_path):
    recs = _paths_records()
    smoke = _results(tmp_path, {"05_execution_paths": recs}, preset="smoke")
    rows = {i: _row_of(smoke, i) for i in ("A11-1", "A11-2", "A11-3")}
    assert {r["verdict"] for r in rows.values()} == {"undecided at this size"}
    assert rows["A11-1"]["estimate"] == 100.0
    fp32 = _results(tmp_path, {"05_execution_paths": _paths_records(dtype="float32")})
    row = _row_of(fp32, "A11-3")
    assert row["verdict"] == cl.NOT_COMPUTED and row["note"] == (
        "05_execution_paths has no bfloat16 cell (the paper's precision; this run: float32)")
    short = _results(tmp_path, {"05_execution_paths": recs[recs.condition != "replay"]})
    assert "cannot compute yet: ValueError" in _row_of(short, "A11-1")["note"]
    bad = _results(tmp_path, {"05_execution_paths": recs.assign(token_ids="1 2")})
    assert "token_ids '1 2' is not a list of token ids" in _row_of(bad, "A11-2")["note"]


def _session_runs(debt, sur, shift=None):
    """Notebook 07's runs (``agent_session.run_episodes``' columns the decisions read): 12 episodes of ``len(sur) //
    12`` edits, one question after each, with each arm's agreement with Re-prefill given per (episode, edit) in
    episode order (Shift: none; Re-prefill: every one, with itself)."""
    from sur_lab.studies import agent_session as ag

    k = len(sur) // 12
    shift = np.zeros(len(sur)) if shift is None else shift
    rows = []
    arms = (("Shift", shift), ("SUR 5%", sur), ("SUR 5% + debt 10%", debt), (ag.REFERENCE, np.ones(len(sur))))
    for arm, agree in arms:
        for i, a in enumerate(agree):
            rows.append({"episode": f"e{i // k:02d}", "edit": i % k + 1, "arm": arm, "agree": bool(a)})
    return pd.DataFrame(rows)


def _lose(episodes, k=20):
    """Agreement over 12 episodes of ``k`` questions: lost on the first question of each of ``episodes``."""
    agree = np.ones(12 * k)
    agree[[e * k for e in episodes]] = 0
    return agree


def test_agent_session_row_is_both_declared_parts_from_the_saved_decided_table(tmp_path):
    """B8 = :func:`all_of` the equivalence of per-edit SUR with Re-prefill within the declared margin and the debt
    arm's primary, both read from ``07_agent_session_decided`` as ``decide_families`` (= ``paired_family``) wrote it;
    the cost part is named as not decided."""
    from sur_lab.studies import agent_session as ag

    arms = ag.default_arms([5], debt_budget=5, debt_pct=10)
    episodes = np.repeat([f"e{e:02d}" for e in range(12)], 20)  # the clusters, in the units' order
    debt, sur = "SUR 5% + debt 10%", "SUR 5%"
    close, narrows = "close to re-prefill", "the debt arm narrows the rest"

    def b8(decided):
        return _row_of(_results(tmp_path, {"07_agent_session_decided": decided}), "B8")

    def part(decided, family):
        return decided[decided.family == family.name].iloc[0]

    # every answer kept by both arms, 240 questions: SUR is equivalent to Re-prefill (its 90 % interval inside ±5
    # points), the debt arm not separated from SUR: the claim is undecided, shown on the debt arm's part
    same = ag.decide_families(_session_runs(np.ones(240), np.ones(240)), arms, n_boot=1000, seed=0)
    eq = _decided({(sur, ag.REFERENCE): (np.ones(240), np.ones(240))}, family=ag.REPREFILL_FAMILY, cluster=episodes)
    pd.testing.assert_frame_equal(same[same.family == ag.REPREFILL_FAMILY.name].reset_index(drop=True), eq)
    assert eq.iloc[0].verdict == "equivalent" and eq.iloc[0].margin == 0.05
    p = part(same, ag.PRIMARY)
    row = b8(same)
    assert row["table"] == "07_agent_session_decided" and row["unit"] == "pp agreement with Re-prefill"
    assert row["verdict"] == "undecided at this size" and row["n"] == 240 and row["mde"] == 100 * p.mde == 2.5
    assert (row["estimate"], row["ci_low"], row["ci_high"]) == (0.0, 100 * p.ci_low, 100 * p.ci_high)
    assert row["note"].startswith(f"all of 2 must hold; shown: {narrows}. {close}: ")
    assert (f"{close}: +0 pp agreement with Re-prefill [-1.58, +1.58] (n 240 in 12 clusters; p 1) holds (") in row["note"]
    assert (f"{narrows}: +0 pp agreement with Re-prefill [-1.58, +1.58] (n 240 in 12 clusters; p 1) undecided at this "
            "size (") in row["note"]
    assert row["note"].endswith("Not decided: 'a fraction of its recomputation' (07_agent_session_summary's "
                                "cost_ratio, a mean without an interval)")

    # SUR keeps every answer but one, the debt arm loses one in each of six other episodes: the first part holds,
    # the second does not (-2.5 pp, 6 episodes all one way: exact sign test p = 1/32), so the claim does not hold
    worse = ag.decide_families(_session_runs(_lose(range(7)), _lose([0])), arms, n_boot=1000, seed=0)
    assert part(worse, ag.REPREFILL_FAMILY).verdict == "equivalent"
    p = part(worse, ag.PRIMARY)
    assert p.verdict == "loses to" and p.p == 2 * 0.5 ** 6 and p.estimate == -6 / 240
    row = b8(worse)
    assert row["verdict"] == "does not hold" and row["note"].startswith(f"all of 2 must hold; shown: {narrows}.")
    assert (row["estimate"], row["ci_low"], row["ci_high"]) == (100 * p.estimate, 100 * p.ci_low, 100 * p.ci_high)

    # the debt arm keeps what SUR lost in six episodes (+2.5 pp, shown): SUR, 2.5 points below Re-prefill and so
    # inside the margin, is then also shown to lose to Re-prefill, a separation that decisions.judge puts before
    # equivalence, so the first part does not hold (the two parts conflict: see agent_session.REPREFILL_FAMILY)
    better = ag.decide_families(_session_runs(np.ones(240), _lose(range(6))), arms, n_boot=1000, seed=0)
    assert part(better, ag.PRIMARY).verdict == "beats"
    e = part(better, ag.REPREFILL_FAMILY)
    assert e.verdict == "loses to" and e.estimate == -6 / 240 and -0.05 < e.tost_low
    row = b8(better)
    assert row["verdict"] == "does not hold" and row["note"].startswith(f"all of 2 must hold; shown: {close}.")
    assert (row["estimate"], row["ci_low"], row["ci_high"]) == (100 * e.estimate, 100 * e.ci_low, 100 * e.ci_high)

    # SUR loses two answers in every episode (-10 pp, its interval beyond the margin): does not hold
    lost = np.ones(240)
    lost[::10] = 0
    far = ag.decide_families(_session_runs(lost, lost), arms, n_boot=1000, seed=0)
    e = part(far, ag.REPREFILL_FAMILY)
    assert e.verdict == "loses to" and e.estimate == -0.1 and e.ci_high < -0.05
    assert b8(far)["verdict"] == "does not hold"

    # a plumbing-check table decides nothing: undecided, never a verdict from its point estimates
    smoke = ag.decide_families(_session_runs(np.ones(240), _lose(range(6))), arms, n_boot=1000, seed=0,
                               decide=False)
    assert (smoke.verdict == "not decided").all()
    row = b8(smoke)
    assert row["verdict"] == "undecided at this size" and row["estimate"] == -2.5  # the first part, on a tie

    # a part that did not run: B8 is not computed (no verdict), whichever part it is
    plain = ag.decide_families(_session_runs(np.ones(240), np.ones(240)), ag.default_arms([5]), n_boot=1000, seed=0)
    row = b8(plain)
    assert set(plain.family) == {ag.REPREFILL_FAMILY.name, ag.BUDGET_FAMILY.name} and row["verdict"] == cl.NOT_COMPUTED
    assert "has no row for the debt arm against SUR at its budget" in row["note"]
    row = b8(same[same.family != ag.REPREFILL_FAMILY.name])  # a table written before the margin was declared
    assert row["verdict"] == cl.NOT_COMPUTED and "has no row for per-edit SUR against Re-prefill" in row["note"]


def test_every_computed_claim_reads_a_table_its_notebook_saves():
    """A computed row reads a table its notebook writes (a ``save_table`` call names it in a code cell): a table that
    no notebook saves would leave the row "not yet computed" in every release."""
    code = {p.stem: "".join("".join(c["source"]) for c in json.loads(p.read_text())["cells"]
                            if c["cell_type"] == "code") for p in notebooks("*")}
    computed = [c for c in cl.CLAIMS if c.compute is not None and not (c.compute.__doc__ or "").startswith(
        "Not computed")]
    assert "B8" in {c.id for c in computed}
    # arguments may nest calls two deep before the name (notebook 05: ``save_table(df.assign(x=df.x.map(str)), ...``)
    call = r'save_table\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*?"{}"'
    unsaved = [(c.id, c.table) for c in computed if not re.search(call.format(c.table), code[c.notebook])]
    assert not unsaved, unsaved
    assert re.search(call.format("05_execution_paths"), code["05_kernel_numerical_validation"])


def test_a11_reads_the_decodes_as_notebook_05_saves_them(tmp_path):
    """``execution_paths.run`` on a tiny bfloat16 model, saved as notebook 05 saves it (``save_table`` with the run
    tag, ``token_ids`` as text): the rows equal the bound and the paired comparisons of ``cell_table`` on the
    in-memory records."""
    from types import SimpleNamespace

    import torch
    from conftest import make_tiny_model

    from sur_lab.analysis.decisions import bound_claim, claim_of_bound, claim_verdict
    from sur_lab.analysis.plotting import run_tag, save_table
    from sur_lab.edits import token_edit
    from sur_lab.studies import execution_paths as ep

    lm = make_tiny_model("llama", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    cases = [SimpleNamespace(case_id=f"hotpotqa/{i}/cell", meta={"dataset": "hotpotqa", "source_id": str(i // 2),
                                                                   "cell": "downstream/short"},
                             edit=token_edit(torch.randint(1, 90, (40,), generator=g), 4, 3, [7, 8]),
                             answer_ids=[5, 6]) for i in range(4)]
    records = ep.run(lm, cases, repeats=3, max_new_tokens=2)
    save_table(records.assign(token_ids=records.token_ids.map(str)), "05_execution_paths", outputs=tmp_path,
               tag=run_tag(model=lm.spec.name, device="cpu", preset="default", dtypes=["bfloat16"], repeats=3))
    results = _results(tmp_path, {}, finished=["05_kernel_numerical_validation"])
    cells = ep.cell_table(records)
    assert len(cells) == 4 and set(cells["dtype"]) == {"bfloat16"}
    k = int((cells["cross_exact_logits"] == 0).sum())
    a1 = _row_of(results, "A11-1")
    word = bound_claim(k, 4, at_least=cl.A11_EVERY_CELL)
    assert a1["n"] == 4 and math.isclose(a1["estimate"], 100 * k / 4) and a1["verdict"] == claim_of_bound(word)
    a3 = _row_of(results, "A11-3")
    nll = paired_family({("cross-path |dNLL|", "within-Re-prefill |dNLL|"): (cells["nll_cross"],
                                                                            cells["nll_within"])},
                        family=cl.A11_NLL).iloc[0]
    assert a3["n"] == 4 and a3["estimate"] == nll.estimate
    assert a3["verdict"] == claim_verdict(nll.verdict, "greater")
    a2 = _row_of(results, "A11-2")
    assert a2["n"] == 4 and a2["verdict"] in cl.VERDICTS


def test_p4_needs_a_near_perfect_sur_and_is_undecided_while_its_80_percent_half_is_not_run(tmp_path):
    """P4 needs Dense tokens at 80 %, which no preset's declared family compares: the conjunction never holds. SUR's
    own EM at 5 % below near-perfect (an upper bound under 95 %) or Dense tokens beating SUR at 5 % makes it fail."""
    records = pd.DataFrame({"method": "SUR", "budget_pct": 5.0, "em": [True] * 48})  # 48 of 48: lower bound 92.6 %
    rivals = _decided({("SUR 5%", "Dense tokens 5%"): (ONES, ZEROS)}, family=RIVALS)
    tables = {"02_budget_table_em": EM_LEAD, "02_sur_vs_allocators": rivals, "02_niah_records": records}
    row = _row_of(_results(tmp_path, tables), "P4")
    assert row["verdict"] == "undecided at this size" and row["n"] == 48 and row["estimate"] == 100.0
    assert "SUR 5% vs Dense tokens 5%: +100 pp EM" in row["note"] and "Dense tokens at 80 %" in row["note"]
    assert "decided by no preset yet" in row["note"]  # the part's own reading is kept in the conjunction's note
    tables["02_sur_vs_allocators"] = _decided({("SUR 5%", "Dense tokens 5%"): (ZEROS, ONES)}, family=RIVALS)
    row = _row_of(_results(tmp_path, tables), "P4")
    assert row["verdict"] == "does not hold" and row["estimate"] == -100.0 and row["n"] == 48
    tables["02_sur_vs_allocators"] = rivals
    tables["02_niah_records"] = records.assign(em=[True] * 31 + [False] * 17)  # 64.6 %: upper bound 77.8 % < 95 %
    row = _row_of(_results(tmp_path, tables), "P4")
    _, low, high = proportion_interval(31, 48)
    assert row["verdict"] == "does not hold" and (row["estimate"], row["ci_low"], row["ci_high"]) == pytest.approx(
        (100 * 31 / 48, 100 * low, 100 * high), rel=1e-12)


def test_verdict_says_when_no_difference_can_separate():
    """Six clusters under Holm over three cannot reach the first step's 1.67 % (it needs seven, all one way): the
    verdict says so instead of quoting a smallest separable difference."""
    row = {"verdict": "undecided at this size", "estimate": 1.65, "n": 18, "n_clusters": 6, "p": 0.094,
           "family_size": 3, "mde": None, "unit": "x"}
    assert cl.format_verdict(row) == ("undecided at this size (no difference can separate: it needs at least 7 "
                                      "clusters under Holm over 3)")
    assert cl.too_few_units({**row, "n_clusters": 7}) is None
    assert cl.format_verdict({**row, "n_clusters": 7, "mde": 0.2}) == "undecided at this size (smallest separable: " \
                                                                     "0.2 x)"
    assert cl.format_verdict({**row, "n_clusters": None, "n": 5, "family_size": 1}) == (
        "undecided at this size (no difference can separate: it needs at least 6 units)")
    assert cl.format_estimate({"estimate": None, "verdict": "undecided at this size", "n": None,
                               "note": "ledger: not separated"}) == "– (decided in words: see how it was read)"
    assert cl.format_estimate({"estimate": None, "verdict": "undecided at this size", "n": 0, "note": "x"}) == "–"


def _sweep_runs(doc_first, comp_first, suffix_first, suffix_last, *, n):
    """``06_noprefix_sweep_runs`` as notebook 06 saves it: per source (``n`` of them) and slot (0, 1, 2), the forwarded
    and donor rows of each path with its ``preserved`` flag; the arguments are each source's flag (arrays)."""
    rows = []
    for i in range(n):
        for slot in (0, 1, 2):
            flags = {"Doc K2 · oracle": doc_first[i] if slot == 0 else 1,
                     "Prefix composition": comp_first[i] if slot == 0 else 0,
                     "Suffix K1 · oracle": suffix_first[i] if slot == 0 else suffix_last[i] if slot == 2 else 1}
            for label, flag in flags.items():
                for protocol in ("forward", "donor"):
                    rows.append({"dataset": "hotpotqa", "source_id": f"s{i}", "slot": slot, "label": label,
                                 "method": label.split(" · ")[0], "protocol": protocol,
                                 # the donor rows say the opposite: only the forwarded ones may be read
                                 "preserved": bool(flag) if protocol == "forward" else not flag})
    return pd.DataFrame(rows)


def test_s8_decides_its_two_halves_on_the_position_sweep_requests(tmp_path):
    """S8 from ``06_noprefix_sweep_runs``: with the evidence first, document-only patching loses to composition (the
    "no better than" half holds) and suffix repair keeps every answer in both the first and the last slot (0 of 200
    discordant: the 90 % interval inside the ledger's 5-point margin, equivalent), so S8 holds; document-only patching
    that beats composition makes it fail; at four sources it is undecided."""
    n = 200
    ones, zeros = np.ones(n), np.zeros(n)
    half = np.r_[np.zeros(n // 2), np.ones(n // 2)]
    row = _row_of(_results(tmp_path, {"06_noprefix_sweep_runs": _sweep_runs(zeros, half, ones, ones, n=n)}), "S8")
    assert row["verdict"] == "holds", row["note"]
    assert "all of 2 must hold" in row["note"] and "with the evidence in slot 0 minus slot 2" in row["note"]
    # the shown part is the first (a tie in rank keeps the order): doc-only minus composition, -50 pp
    assert row["estimate"] == -50.0 and row["n"] == n and row["unit"] == "pp preservation"
    row = _row_of(_results(tmp_path, {"06_noprefix_sweep_runs": _sweep_runs(ones, half, ones, ones, n=n)}), "S8")
    assert row["verdict"] == "does not hold" and row["estimate"] == 50.0
    four = np.ones(4)
    row = _row_of(_results(tmp_path, {"06_noprefix_sweep_runs": _sweep_runs(four, four, four, four, n=4)}), "S8")
    assert row["verdict"] == "undecided at this size" and row["n"] == 4
    one_slot = _sweep_runs(four, four, four, four, n=4).query("slot == 0")
    row = _row_of(_results(tmp_path, {"06_noprefix_sweep_runs": one_slot}), "S8")
    assert row["verdict"] == cl.NOT_COMPUTED and "fewer than two evidence slots" in row["note"]


def test_no_better_reads_loses_and_equivalent_as_holding():
    from sur_lab.analysis.decisions import claim_verdict

    assert [claim_verdict(v, cl._no_better(v)) for v in ("loses to", "equivalent", "beats", "not separated")] == [
        "holds", "holds", "does not hold", "undecided at this size"]


def _qa_records(selectors, *, n_sources=8, sur_ms=100.0, selector_ms=300.0, timed=True):
    """``03_natural_qa_records`` as notebook 03 saves it, trimmed to what the claims read: per source and placement,
    SUR at 5 %, each selector at 5 % and the references, with Eq. 20's parts (the selector slower)."""
    rows = []
    for i in range(n_sources):
        for placement in ("before", "between", "after"):
            for method, budget, ms in (("SUR", 5.0, sur_ms), *((s, 5.0, selector_ms + i) for s in selectors),
                                       ("Shift", np.nan, 10.0), ("Re-prefill", np.nan, 500.0)):
                rows.append({"dataset": "hotpotqa", "source_id": f"s{i}", "placement": placement, "method": method,
                             "budget_pct": budget, "em": True, "prediction": "x", "timed": timed,
                             "select_ms": 1.0, "shift_ms": 1.0, "refresh_ms": ms - 3.0, "answer_ms": 1.0,
                             "latency_ms": ms})
    return pd.DataFrame(rows)


def test_p14_decides_em_and_latency_per_selector_and_needs_all_three(tmp_path):
    """P14 at a preset that runs the selectors: EM from 03_decisions' family of rivals, latency declared here on the
    timed records (24 cases in 8 source clusters, each selector 3x slower): both halves beat for the selectors that
    ran; one selector not run leaves the claim undecided; none run: 0 units."""
    from sur_lab.studies import natural_qa as qa

    t7 = pd.DataFrame({"condition": ["SUR 5%", "Re-prefill"], "em_pct": [40.0, 90.0]})  # EM leads
    sel = list(cl.P14_SELECTORS)
    rivals = _decided({("SUR 5%", f"{s} 5%"): (ONES, HALF) for s in sel}, family=qa.RIVALS)
    tables = {"03_decisions": rivals, "03_table7_quality_latency": t7, "03_natural_qa_records": _qa_records(sel)}
    row = _row_of(_results(tmp_path, tables), "P14")
    assert row["verdict"] == "holds", row["note"]
    assert "all of 6 must hold" in row["note"] and f"latency: SUR 5% vs {sel[0]} 5%: +3" in row["note"]
    assert "post-edit latency against the selectors (P14), Holm over 3" in row["note"]
    # the latency ratio is the study's own pairing: (selector ms) / (SUR ms) per case, geometric mean
    expected = float(np.exp(np.mean(np.log([(300.0 + i) / 100.0 for i in range(8) for _ in range(3)]))))
    assert f"latency: SUR 5% vs {sel[0]} 5%: +{expected:.3g} x" in row["note"]
    tables["03_natural_qa_records"] = _qa_records(sel[:2])
    row = _row_of(_results(tmp_path, tables), "P14")
    assert row["verdict"] == "undecided at this size" and f"not run at this preset: notebook 03 ran no {sel[2]}" in (
        row["note"])
    tables["03_natural_qa_records"] = _qa_records([])
    row = _row_of(_results(tmp_path, tables), "P14")
    assert row["verdict"] == "undecided at this size" and row["n"] == 0
    assert row["note"].startswith("not run at this preset: notebook 03 ran none of CacheBlend-Adapted")
