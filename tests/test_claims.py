"""The claims table: a registry of the paper's claims, SAFE-KV's rules and the questions beyond them, rendered from a
results folder; rows that are not computed say so and never carry a verdict, and every verdict comes from one
function that maps the decisions module's words."""

from __future__ import annotations

import csv
import io
import json

import pytest

from sur_lab.runtime import claims as cl
from sur_lab.runtime.run_notebooks import notebooks

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
    assert cl.format_verdict(rows[0]) == "undecided at this size (smallest detectable: 9.3 pp EM)"
    assert rows[1]["verdict"] == cl.NOT_COMPUTED and "ImportError" in rows[1]["note"]
    assert rows[2]["verdict"] == cl.NOT_COMPUTED
    assert rows[2]["note"] == "09_stale_facts has not finished in this release"
    md = cl.claims_markdown(rows, link=lambda stem: f"../{stem}/")
    assert "| P1 | SUR beats Dense tokens. <small>(§5)</small> | 89.6 vs 7.3 % | +12.5 pp EM [+4.2, +20.8] (n 96) | " \
           "undecided at this size (smallest detectable: 9.3 pp EM) | [`02`](../02_allocation_geometry/) " \
           "`02_table12` |" in md
    assert md.index("## The paper") < md.index("## Beyond the papers")
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
