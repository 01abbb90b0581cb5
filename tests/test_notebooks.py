"""Every notebook (found by glob) is committed clean, declares annotated parameters, keeps measured numbers out of its
markdown, and runs under papermill with its own smoke parameters, writing the figures and tables that
``tests/notebook_outputs.py`` declares for it."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from notebook_outputs import EXPECTED, PENDING
from sur_lab.analysis.plotting import STATIC_OUTPUTS_ENV
from sur_lab.runtime.run_notebooks import (NOTEBOOK_DIR, declared_parameters, final_progress_bars, run_notebook,
                                           smoke_parameters)
from sur_lab.studies import POWER_STUDIES, get_study
from sur_lab.studies.presets import PRESET_ENV, SMOKE_BANNER

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))

#: Notebooks whose "This run" cell prints the primary comparison's power statement (issue 40).
POWER_NOTEBOOKS = {*(get_study(n).notebook for n in POWER_STUDIES), "07_agent_session"}


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


#: Calls whose value (the written paths) would be printed as a raw ``[PosixPath(...)]`` output at a cell's end.
SAVING_CALLS = {"save_figure", "save_table"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_ends_in_a_bare_saving_call(path):
    """A figure- or table-saving call that ends a cell would print its list of paths under the figure; its result is
    assigned instead (or another statement ends the cell)."""
    bare = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        body = ast.parse("".join(cell["source"])).body
        last = body[-1] if body else None
        if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call):
            func = last.value.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in SAVING_CALLS:
                bare.append((i, name))
    assert not bare, f"cells ending in a bare saving call (assign its result): {bare}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_smoke_banner_comes_just_before_this_run(path):
    """Every notebook calls the one banner function in a cell of its own (tag ``smoke-banner``) right before its
    generated "This run" summary, the last code cell; with its ``preset`` parameter when it has one, else the runner
    says (``$SUR_LAB_PRESET``)."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    tagged = [i for i, c in enumerate(cells) if "smoke-banner" in c["metadata"].get("tags", [])]
    assert tagged == [len(cells) - 2], "one smoke-banner cell, just before the last code cell"
    call = "show_smoke_banner(preset)" if "preset" in declared_parameters(path) else "show_smoke_banner()"
    assert call in "".join(cells[tagged[0]]["source"])


def test_smoke_banner_says_when(monkeypatch, capsys):
    from sur_lab.studies.presets import show_smoke_banner, smoke_banner

    monkeypatch.delenv(PRESET_ENV, raising=False)
    assert smoke_banner("default") == smoke_banner() == ""
    assert SMOKE_BANNER in smoke_banner("smoke")
    monkeypatch.setenv(PRESET_ENV, "smoke")
    assert SMOKE_BANNER in smoke_banner() and smoke_banner("default") == ""  # a notebook's own preset wins
    show_smoke_banner()
    assert SMOKE_BANNER in capsys.readouterr().out


def _tqdm_output(model_id: str) -> dict:
    return {"output_type": "display_data", "metadata": {},
            "data": {"text/plain": "Loading weights:   0%|          | 0/272 [00:00<?, ?it/s]",
                     "application/vnd.jupyter.widget-view+json": {"model_id": model_id, "version_major": 2,
                                                                   "version_minor": 0}}}


def test_progress_bars_are_left_in_their_final_state():
    def model(name, **state):
        return {"model_name": name, "state": state}

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [_tqdm_output("box"), _tqdm_output("lost"), {"output_type": "stream", "name": "stdout",
                                                                 "text": "done\n"}]
    nb.cells.append(cell)
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {
        "box": model("HBoxModel", children=["IPY_MODEL_a", "IPY_MODEL_b", "IPY_MODEL_c"]),
        "a": model("HTMLModel", value="Loading\u2007weights:\u2007100%"),
        "b": model("FloatProgressModel", value=272.0, max=272.0),
        "c": model("HTMLModel", value="\u2007272/272\u2007[00:00&lt;00:00,\u20079820.87it/s]")}}}
    assert final_progress_bars(nb) == 2
    outs = nb.cells[0].outputs
    assert outs[0]["data"] == {"text/plain": "Loading weights: 100%|██████████| 272/272 [00:00<00:00, 9820.87it/s]"}
    assert len(outs) == 2 and outs[1]["text"] == "done\n"  # a bar without saved state is cleared
    assert "widgets" not in nb.metadata


def test_the_kernel_writes_into_the_absolute_outputs_folder(tmp_path, monkeypatch):
    """A relative outputs folder is made absolute before the kernel starts in the notebook's folder: what the notebook
    writes lands beside its executed copy, and the kernel is told the preset."""
    folder = tmp_path / "nbs"
    folder.mkdir()
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("x: int = 1  # a number {0..}")
    params.metadata["tags"] = ["parameters"]
    nb.cells += [params, nbformat.v4.new_code_cell(
        "import os\nfrom sur_lab.paths import outputs_dir\n"
        "(outputs_dir() / 'where.txt').write_text(os.environ.get('SUR_LAB_PRESET', 'none') + ' ' + os.getcwd())")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["sur_lab"] = {"smoke_parameters": {"x": 2}}
    nbformat.write(nb, folder / "probe.ipynb")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SUR_LAB_OUTPUTS_DIR", "elsewhere")  # the runner's folder wins
    run_notebook(folder / "probe.ipynb", {"x": 2}, outputs=Path("run"), progress=False)
    preset, cwd = (tmp_path / "run" / "where.txt").read_text().split(" ", 1)
    assert preset == "smoke" and Path(cwd) == folder  # smoke parameters: the smoke preset; the kernel ran in nbs/
    assert (tmp_path / "run" / "probe.ipynb").is_file() and not (folder / "run").exists()
    run_notebook(folder / "probe.ipynb", {"x": 3}, outputs=tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "where.txt").read_text().startswith("none ")


#: A number followed by a unit (%, pp, ms, s, min, h, tokens, ×, x; optionally K/M-scaled, with a space or hyphen):
#: a measured value typed into markdown, which goes stale with the next run. Stricter than the before-stop check's
#: ``\d[\d.,]*\s?(?:%|pp\b|ms\b|tokens\b|×)``: it also catches seconds, minutes, hours, "278-token" and "8K tokens".
TYPED_MEASUREMENT = re.compile(
    r"\d[\d.,]*\s?[KkM]?[\s-]?(?:%|pp\b|ms\b|µs\b|us\b|s\b|sec\b|seconds?\b|min\b|minutes?\b|h\b|hours?\b|"
    r"tokens?\b|×|x\b)")


def typed_measurements(path: Path) -> list[str]:
    """Every match of :data:`TYPED_MEASUREMENT` in the notebook's markdown cells, with a little context."""
    found = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"])
            found += [text[max(0, m.start() - 25): m.end() + 5].replace("\n", " ") for m in TYPED_MEASUREMENT.finditer(text)]
    return found


def test_typed_measurement_pattern():
    hits = ["took 372 s on one", "about 1,000 tokens", "a 278-token passage", "rose 9.4 %", "within 10× of",
            "8K tokens", "3 minutes per", "+2.5 pp EM", "12 ms"]
    misses = ["Eq. 25", "Table 18", "R = 16 intervals", "1e-8", "layer 0", "10^{-13}", "budget b (%)"]
    assert all(TYPED_MEASUREMENT.search(h) for h in hits), [h for h in hits if not TYPED_MEASUREMENT.search(h)]
    assert not any(TYPED_MEASUREMENT.search(m) for m in misses), [m for m in misses if TYPED_MEASUREMENT.search(m)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_markdown_has_no_typed_measurement(path):
    found = typed_measurements(path)
    assert not found, f"numbers with units typed into markdown (take them from a cell that reads this run's tables): {found}"


def run_parameters(path: Path) -> dict:
    """The parameter values a smoke run uses: the notebook's literal defaults, overridden by its smoke parameters."""
    params = {}
    for name, p in declared_parameters(path).items():
        try:
            params[name] = ast.literal_eval(p["default"])
        except (ValueError, SyntaxError):
            params[name] = p["default"]
    return {**params, **smoke_parameters(path)}


def written(folder: Path, name: str, suffix: str) -> list[Path]:
    """Files ``name.suffix`` or ``name_<tag>.suffix`` (tags are ``key-value`` pairs, so ``05_x`` does not match
    ``05_x_layers_...``)."""
    out = []
    for p in folder.glob(f"{name}*{suffix}"):
        rest = p.name[len(name):-len(suffix)]
        if rest == "" or (rest.startswith("_") and "-" in rest[1:].split("_")[0]):
            out.append(p)
    return out


def check_outputs(name: str, executed: Path, outputs: Path, params: dict) -> None:
    """Assert that a smoke run of notebook ``name`` wrote what :data:`EXPECTED` declares for it."""
    expected = EXPECTED[name]
    for fig in expected.figures:
        for suffix in (".png", ".pdf"):
            files = written(outputs / "figures", fig, suffix)
            assert len(files) == 1, f"figure {fig}{suffix}: found {[f.name for f in files]}"
            assert files[0].stat().st_size > 1000
    for table, spec in expected.tables.items():
        files = written(outputs / "tables", table, ".csv")
        assert len(files) == 1, f"table {table}.csv: found {[f.name for f in files]}"
        df = pd.read_csv(files[0])
        missing = [c for c in spec.columns if c not in df.columns]
        assert not missing, f"{table}: missing columns {missing} (has {list(df.columns)})"
        if spec.rows is None:
            assert len(df) >= 1, f"{table} is empty"
        else:
            assert len(df) == spec.rows(params), f"{table}: {len(df)} rows, expected {spec.rows(params)}"
        nan = [c for c in spec.not_null if df[c].isna().any()]
        assert not nan, f"{table}: NaN in {nan}"
        if spec.check is not None:
            spec.check(df, params)
    nb = json.loads(executed.read_text())
    outputs_of = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    views = [o for o in outputs_of if "sur-token-view" in "".join(o.get("data", {}).get("text/html", ""))]
    assert len(views) == expected.token_views, f"{len(views)} token views, expected {expected.token_views}"
    for view in views:
        assert "application/vnd.jupyter.widget-view+json" not in view["data"], "executed copies keep static views"
        assert "".join(view["data"]["text/html"]).count("<del>") in (1, 2), "one deleted span (its middle elided)"
    # A cell's printed text, its stream outputs joined: the kernel may flush one cell's prints as one output or as
    # several, depending on timing (CI saw "This run: ..." and the "Power: ..." line that followed split in two).
    printed = ["".join("".join(o["text"]) for o in c.get("outputs", []) if o.get("output_type") == "stream")
               for c in nb["cells"] if c["cell_type"] == "code"]
    summary = [t[t.index("This run:"):] for t in printed if "This run:" in t]
    assert summary or name in PENDING, "the conclusion's generated cell ('This run: ...') printed nothing"
    assert SMOKE_BANNER in "".join(printed), "a smoke run prints its banner above 'This run'"
    if name in POWER_NOTEBOOKS:  # issue 40: the primary comparison's power statement, generated
        assert "\nPower: " in "".join(summary), "'This run' prints the power statement"
    plain = ["".join(o.get("data", {}).get("text/plain", "")) for o in outputs_of]
    assert not [t for t in plain if "PosixPath(" in t], "a raw list of written paths is shown"
    assert not [o for o in outputs_of if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert not [t for t in plain if re.search(r"\s0%\|", t)], "a progress bar is shown frozen at 0 %"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_with_smoke_parameters(path, tmp_path, monkeypatch):
    monkeypatch.setenv("SUR_LAB_OUTPUTS_DIR", str(tmp_path))
    monkeypatch.delenv(STATIC_OUTPUTS_ENV, raising=False)  # the runner sets it for the kernel itself
    executed = run_notebook(path, smoke_parameters(path), outputs=tmp_path, progress=False)
    assert executed.is_file()
    if path.stem in EXPECTED:
        check_outputs(path.stem, executed, tmp_path, run_parameters(path))
        return
    assert path.stem in PENDING, f"declare what {path.name} writes in tests/notebook_outputs.py (EXPECTED)"
    pngs = list((tmp_path / "figures").glob("*.png"))
    pdfs = list((tmp_path / "figures").glob("*.pdf"))
    tables = list((tmp_path / "tables").glob("*.csv")) + list((tmp_path / "tables").glob("*.parquet"))
    assert pngs and pdfs and tables, f"figures {pngs} {pdfs}, tables {tables}"
    assert all(p.stat().st_size > 1000 for p in pngs)
