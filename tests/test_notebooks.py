"""Every notebook (found by glob) is committed clean, declares annotated parameters, and runs under papermill with its
own smoke parameters, writing at least one figure (PNG and PDF) and one table."""

from __future__ import annotations

import json

import nbformat
import pytest

from sur_lab.runtime.run_notebooks import NOTEBOOK_DIR, declared_parameters, run_notebook, smoke_parameters

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_notebooks_exist():
    assert any(p.name.startswith("00_quickstart") for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_clean_and_parameterized(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "commit without outputs"
    raw = json.loads(path.read_text())  # nbformat.read fills missing ids in (with a warning): check the file itself
    assert all(c.get("id") for c in raw["cells"]), "every cell needs an id (nbformat 4.5; nbformat.validator.normalize)"
    tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    declared = declared_parameters(path)
    assert declared, "the parameters cell declares no parameter"
    unannotated = [name for name, p in declared.items() if p["inferred_type_name"] == "None"]
    assert not unannotated, f"parameters without a type annotation: {unannotated}"
    smoke = smoke_parameters(path)
    assert smoke, "notebook metadata needs sur_lab.smoke_parameters"
    assert set(smoke) <= set(declared), f"smoke parameters not declared: {set(smoke) - set(declared)}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_with_smoke_parameters(path, tmp_path, monkeypatch):
    monkeypatch.setenv("SUR_LAB_OUTPUTS_DIR", str(tmp_path))
    executed = run_notebook(path, smoke_parameters(path), outputs=tmp_path, progress=False)
    assert executed.is_file()
    pngs = list((tmp_path / "figures").glob("*.png"))
    pdfs = list((tmp_path / "figures").glob("*.pdf"))
    tables = list((tmp_path / "tables").glob("*.csv")) + list((tmp_path / "tables").glob("*.parquet"))
    assert pngs and pdfs and tables, f"figures {pngs} {pdfs}, tables {tables}"
    assert all(p.stat().st_size > 1000 for p in pngs)
