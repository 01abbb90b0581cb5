"""What each study's run cost and what it can decide (``sur_lab.runtime.sizes``, the index's section and ``sur-lab
release --sizes``), on synthetic results folders: hand-written manifests, records, ``sweep.json`` files and decided
tables. No notebook runs and no model loads."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from sur_lab.analysis.decisions import COLUMNS as DECISION_COLUMNS
from sur_lab.runtime import release as rel
from sur_lab.runtime import sizes
from sur_lab.runtime.run_notebooks import notebooks, smoke_parameters
from sur_lab.studies import STUDIES

NIAH, QA, STALE, TRACES = (STUDIES[n] for n in ("niah", "natural-qa", "stale-facts", "agent-traces"))
W = "dtype-float32_device-cpu_w-0123abcd"


def _records(folder, case_ids, *, table="records.parquet", column="case_id"):
    folder.mkdir(parents=True)
    pd.DataFrame({column: case_ids, "method": ["SUR"] * len(case_ids)}).to_parquet(folder / table, index=False)
    (folder / "sweep.json").write_text(json.dumps({"cases": sorted(set(case_ids))}))


def _decided(path, rows):
    """A decided table (the decisions schema) with ``rows``: (family, comparison, verdict)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    full = [{**{c: None for c in DECISION_COLUMNS}, "family": f, "comparison": c, "verdict": v} for f, c, v in rows]
    pd.DataFrame(full, columns=DECISION_COLUMNS).to_csv(path, index=False)


def _outputs(results, stem):
    return {p.relative_to(results).as_posix(): {"bytes": 0, "sha256": ""} for p in rel.notebook_outputs(results, stem)}


def _entry(results, stem, *, status="finished", minutes=None, parameters=None, preset="default"):
    return {"status": status, "preset": preset, "parameters": parameters or {},
            "run": {"wall_minutes": minutes} if minutes is not None else {},
            "outputs": _outputs(results, stem) if status != "missing" else {}}


@pytest.fixture
def release_folder(tmp_path):
    """A default release: 02 finished (3 cases, beside a matched-protocol folder; its decided table, and an earlier
    run's that the manifest does not list), 03 failed, 09 finished without a decided primary row (4 cases, beside its
    ``_late`` control folder), 10 finished with keyed rows (2 traces), the rest missing."""
    res = tmp_path / "results"
    _records(res / "sweeps" / f"02_niah_ctx-1024-2048_n-20_{W}", ["a", "a", "b", "c", "c", "c"])
    _records(res / "sweeps" / f"02_niah_matched_ctx-1024_{W}", ["m1", "m2", "m3", "m4", "m5"])
    _decided(res / "tables" / "02_decisions_model-x_n-20.csv",
             [("primary", "SUR 5% vs Shift", "beats"), ("SUR against the other allocators", "SUR 5% vs H2O", "ties")])
    _records(res / "sweeps" / f"09_stale_facts_ctx-256_n-4_{W}", ["s1", "s2", "s3", "s4"])
    _records(res / "sweeps" / f"09_stale_facts_ctx-256_n-4_{W}_late", ["s1-late", "s2-late"])
    _decided(res / "tables" / "09_paired_differences_model-x.csv", [("beyond", "SUR 5% vs Dirty", "beats")])
    pd.DataFrame({"method": ["SUR"], "em": [1.0]}).to_csv(res / "tables" / "09_summary_model-x.csv", index=False)
    folder = res / "sweeps" / f"10_agent_traces_data-hotpotqa_tr-2_{W}"
    _records(folder, ["t1", "t1", "t2"], table="turns.parquet", column="trace")
    manifest = {"schema": 1, "preset": "default", "notebooks": {
        "02_allocation_geometry": _entry(res, "02_allocation_geometry", minutes=12.5,
                                         parameters={"workers": 2, "num_cases": 20}),
        "03_natural_qa_latency": _entry(res, "03_natural_qa_latency", status="failed", minutes=3.0),
        "09_stale_facts": _entry(res, "09_stale_facts", minutes=7.25),
        "10_agent_traces": _entry(res, "10_agent_traces", minutes=0.5),
    }}
    # an earlier run's table, not in the manifest's outputs: not read
    _decided(res / "tables" / "02_decisions_model-x_n-4.csv", [("primary", "SUR 5% vs Shift", "loses to")])
    rel.write_manifest(res, manifest)
    return res


@pytest.fixture
def smoke_folder(tmp_path):
    """A smoke release: 02 finished (1 case), the rest missing."""
    res = tmp_path / "smoke"
    _records(res / "sweeps" / f"02_niah_ctx-256_n-1_{W}", ["z"])
    path = notebooks("02")[0]
    manifest = {"schema": 1, "preset": "smoke", "notebooks": {
        "02_allocation_geometry": _entry(res, "02_allocation_geometry", minutes=0.75,
                                         parameters=smoke_parameters(path), preset="smoke")}}
    rel.write_manifest(res, manifest)
    return res


def _same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_sizes_table_values(release_folder):
    table = sizes.sizes_table(release_folder, rel.read_manifest(release_folder)).set_index("notebook")
    assert list(table.index) == ["02_allocation_geometry", "03_natural_qa_latency", "06_noprefix_reuse",
                                 "08_evidence_location", "09_stale_facts", "10_agent_traces"]
    assert list(table.columns) == sizes.COLUMNS[1:]
    niah = table.loc["02_allocation_geometry"]
    assert (niah["study"], niah["preset"], niah["cases"], niah["wall_minutes"]) == ("niah", "default", 3, 12.5)
    # the MDE at the run's parameters: the manifest's num_cases=20 over the default preset
    effect, unit = NIAH.mde(NIAH.params("default", num_cases=20))
    assert (niah["mde"], niah["mde_unit"]) == (effect, unit) and unit == "pp"
    assert niah["mde"] != NIAH.mde(NIAH.params("default"))[0]
    # the paper preset's MDE: its own sizes, not the run's parameters; smaller than the default's where both decide
    for stem, row in table.iterrows():
        study = sizes.notebook_studies()[stem]
        assert _same(row["paper_mde"], study.mde(study.params("paper"))[0]), stem
    assert niah["paper_mde"] < NIAH.mde(NIAH.params("default"))[0]
    assert math.isnan(QA.mde(QA.params("default"))[0]) and table.loc["03_natural_qa_latency", "paper_mde"] > 0
    assert (niah["family"], niah["comparison"], niah["verdict"]) == (NIAH.primary.name, NIAH.power.comparison, "beats")
    qa = table.loc["03_natural_qa_latency"]
    assert (qa["verdict"], qa["wall_minutes"]) == (sizes.FAILED, 3.0) and pd.isna(qa["cases"])
    assert _same(qa["mde"], QA.mde(QA.params("default"))[0])
    stale = table.loc["09_stale_facts"]  # the _late control folder is not counted; no decided primary row
    assert (stale["cases"], stale["wall_minutes"], stale["verdict"]) == (4, 7.25, sizes.NOT_SAVED)
    assert stale["mde"] == STALE.mde(STALE.params("default"))[0]
    traces = table.loc["10_agent_traces"]  # keyed rows without a case_id column: the sweep.json case list
    assert (traces["cases"], traces["verdict"]) == (2, sizes.NOT_SAVED)
    assert (traces["mde"], traces["mde_unit"]) == TRACES.mde(TRACES.params("default"))
    for stem in ("06_noprefix_reuse", "08_evidence_location"):
        row = table.loc[stem]
        assert row["verdict"] == sizes.NOT_RUN and pd.isna(row["cases"]) and math.isnan(row["wall_minutes"])
        study = sizes.notebook_studies()[stem]
        assert _same(row["mde"], study.mde(study.params("default"))[0])


def test_smoke_columns_side_by_side(release_folder, smoke_folder):
    table = sizes.sizes_table(release_folder, rel.read_manifest(release_folder), smoke=smoke_folder,
                              smoke_manifest=rel.read_manifest(smoke_folder)).set_index("notebook")
    assert list(table.columns) == sizes.COLUMNS[1:] + sizes.SMOKE_COLUMNS
    niah = table.loc["02_allocation_geometry"]
    assert (niah["cases"], niah["smoke_cases"], niah["smoke_minutes"]) == (3, 1, 0.75)
    assert _same(niah["smoke_mde"], NIAH.mde(NIAH.params("smoke"))[0])
    stale = table.loc["09_stale_facts"]  # missing in the smoke folder: its planned smoke parameters
    assert pd.isna(stale["smoke_cases"]) and math.isnan(stale["smoke_minutes"])
    assert _same(stale["smoke_mde"], STALE.mde(STALE.params("smoke"))[0])
    with pytest.raises(ValueError, match="smoke_manifest"):
        sizes.sizes_table(release_folder, {}, smoke=smoke_folder)


def test_case_count_rules(tmp_path, monkeypatch):
    # no manifest entry: every folder counts, and two runs' folders are ambiguous
    _records(tmp_path / "sweeps" / f"09_stale_facts_ctx-256_n-4_{W}", ["s1", "s2"])
    assert sizes.case_count(tmp_path, STALE) == 2
    path = notebooks("09")[0]
    p = sizes.study_parameters(STALE, path, {"num_cases": 4, "context_lens": [512]})
    stem = sizes.folder_stem(STALE, p, sizes.run_values(path, {}))
    assert stem.startswith("09_stale_facts_ctx-512_n-4_b-") and stem.endswith("_seed-0_eb-16_r-" + stem[-8:])
    _records(tmp_path / "sweeps" / f"{stem}_{W}", ["s1"])
    assert sizes.case_count(tmp_path, STALE) is None
    # the folder the run's parameters name settles it (a notebook that runs its study twice, e.g. 06)
    assert sizes.case_count(tmp_path, STALE, stem=stem) == 1
    assert sizes.case_count(tmp_path, STALE, stem="09_stale_facts_ctx-9") is None  # names neither
    # a missing notebook counts nothing from leftover folders; a study that exposes its count gives it
    assert sizes.case_count(tmp_path, STALE, {"status": "missing"}) is None
    monkeypatch.setattr(STALE, "case_count", lambda p: p["num_cases"], raising=False)
    p = STALE.params("default")
    assert sizes.case_count(tmp_path, STALE, {"status": "missing"}, p) == p["num_cases"]


def test_study_parameters_follow_the_run(tmp_path):
    path = notebooks("09")[0]
    assert sizes.study_parameters(STALE, path, {}) == STALE.params("default")
    assert sizes.study_parameters(STALE, path, smoke_parameters(path)) == STALE.params("smoke")
    assert sizes.study_parameters(STALE, path, {}, "smoke") == STALE.params("smoke")  # the manifest's preset
    assert sizes.study_parameters(STALE, path, {"num_cases": 7, "workers": 3}) == STALE.params("default", num_cases=7)


def test_index_and_command(release_folder, smoke_folder, capsys):
    assert rel.main(["--index", "--results", str(release_folder)]) == 0
    readme = (release_folder / "README.md").read_text()
    runs, rest = readme.split("## What each study cost, and what it can decide")
    assert "## Runs" in runs and "## 02_allocation_geometry" in rest  # after the runs, before each notebook's files
    effect = NIAH.mde(NIAH.params("default", num_cases=20))[0]
    paper = NIAH.mde(NIAH.params("paper"))[0]
    assert (f"| `02_allocation_geometry` | default | 3 | 12 min | primary: {NIAH.power.comparison} | {effect:.1f} pp "
            f"| {paper:.1f} pp | beats |") in rest
    assert "| MDE (80 % power) | MDE at `paper` | verdict |" in rest
    assert "| `06_noprefix_reuse` | default | – | – |" in rest and "| not run |" in rest
    capsys.readouterr()
    assert rel.main(["--sizes", str(smoke_folder), "--results", str(release_folder)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("| smoke cases | smoke wall time | smoke MDE |")
    assert "| beats | 1 | 45 s |" in out
    assert rel.main(["--sizes", "--results", str(release_folder)]) == 0
    assert "smoke cases" not in capsys.readouterr().out
    assert rel.main(["--sizes", str(release_folder / "tables"), "--results", str(release_folder)]) == 2
    err = capsys.readouterr().err
    assert "--sizes" in err and "no manifest.json there" in err
