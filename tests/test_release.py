"""The results release (``sur-lab release``): inputs found from import statements, fingerprints that follow code but
not prose, resume and skip logic with a fake notebook runner, ``--check`` (fresh, stale with the changed files named,
missing), and ``--verify`` failing on a tampered results folder. No notebook runs here except one smoke-level release
of notebook 00 (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import nbformat
import pytest

from sur_lab.runtime import release as rel
from fake_release import PNG, fake_runner
from sur_lab.runtime.run_notebooks import notebooks

@pytest.fixture(scope="module")
def two():
    return notebooks("00") + notebooks("01")


def test_inputs_follow_imports_and_ignore_prose(tmp_path):
    root = tmp_path / "repo"
    pkg = root / "sur_lab"
    (pkg / "pkg").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Top."""\nfrom sur_lab.a import f\n')
    (pkg / "a.py").write_text('"""A."""\n\ndef f():\n    from sur_lab import b  # inside a function\n'
                              '    return b.g()\n')
    load = "\n\ndef load():\n    for m in ('sur_lab.late',):\n        importlib.import_module(m)\n"
    (pkg / "b.py").write_text("import importlib\n\ndef g():\n    return 1\n" + load)
    (pkg / "late.py").write_text("y = 2\n")  # imported by name (importlib), as executors.registry does
    (pkg / "unused.py").write_text("x = 1\n")
    (pkg / "pkg" / "__init__.py").write_text("")
    (pkg / "pkg" / "c.py").write_text("from . import d\nfrom .d import h as _h\n")
    (pkg / "pkg" / "d.py").write_text("def h():\n    return 2\n")
    (pkg / "pkg" / "kernel.cpp").write_text("int k;\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%matplotlib inline\nfrom sur_lab.pkg import c\nimport numpy"),
                nbformat.v4.new_markdown_cell("from sur_lab import unused")]
    nb.metadata["sur_lab"] = {"suite_parameters": {}}
    notebook = root / "notebooks" / "00_x.ipynb"
    notebook.parent.mkdir()
    nbformat.write(nb, notebook)
    assert rel.study_modules(notebook, root) == ["sur_lab", "sur_lab.a", "sur_lab.b", "sur_lab.late", "sur_lab.pkg",
                                                 "sur_lab.pkg.c", "sur_lab.pkg.d"]
    files = rel.input_files(notebook, root)
    assert set(files) == {"notebooks/00_x.ipynb", "sur_lab/__init__.py", "sur_lab/a.py", "sur_lab/b.py",
                          "sur_lab/late.py", "sur_lab/pkg/__init__.py", "sur_lab/pkg/c.py", "sur_lab/pkg/d.py",
                          "sur_lab/pkg/kernel.cpp"}
    before = rel.notebook_inputs(notebook, {}, root=root)
    # prose: a docstring, a comment, a bare string and the notebook's markdown change nothing
    (pkg / "a.py").write_text('"""A, reworded."""\n\ndef f():\n    """Doc."""\n    from sur_lab import b  # moved\n'
                              '    "a note"\n    return b.g()\n')
    nb.cells[1].source = "Other prose."
    nbformat.write(nb, notebook)
    assert rel.notebook_inputs(notebook, {}, root=root)["fingerprint"] == before["fingerprint"]
    # code: a changed function body, the kernel's source, a parameter
    (pkg / "b.py").write_text("import importlib\n\ndef g():\n    return 3\n" + load)
    (pkg / "pkg" / "kernel.cpp").write_text("int k = 1;\n")
    after = rel.notebook_inputs(notebook, {}, root=root)
    assert rel.compare_inputs(before, after) == ["changed: sur_lab/b.py, sur_lab/pkg/kernel.cpp"]
    assert rel.compare_inputs(after, rel.notebook_inputs(notebook, {"budgets": [5]}, root=root)) == [
        'parameters: {} -> {"budgets": [5]}']
    (pkg / "pkg" / "c.py").write_text("x = 0\n")  # no longer imports d
    assert rel.compare_inputs(after, rel.notebook_inputs(notebook, {}, root=root)) == [
        "changed: sur_lab/pkg/c.py", "no longer imports: sur_lab/pkg/d.py"]


def test_inputs_of_the_real_notebooks():
    for path in notebooks("*"):
        inputs = rel.notebook_inputs(path)
        assert f"notebooks/{path.name}" in inputs["files"]
        assert "sur_lab/__init__.py" in inputs["files"] and "sur_lab/runtime/params.py" in inputs["files"]
        assert inputs["model"]["model_name"]["sha256"], path.stem  # every default runs an embedded model
        assert inputs["dtype"] == "float32" and len(inputs["fingerprint"]) == 32
    niah = rel.notebook_inputs(notebooks("02")[0])
    package = {f"sur_lab/studies/niah/{m}.py" for m in ("__init__", "cases", "design", "study", "report", "figures",
                                                        "matched")}
    assert package <= set(niah["files"])  # every module
    assert "sur_lab/studies/stale_facts/__init__.py" not in niah["files"]
    assert niah["parameters"] == {"workers": 2}  # its suite parameters
    assert "sur_lab/executors/kernels/onepass.cpp" in niah["files"]


def test_release_runs_skips_and_resumes(tmp_path, two):
    calls: list = []
    assert rel.release(two, tmp_path, runner=fake_runner(calls), progress=False) == 0
    assert calls == ["00_quickstart", "01_theory_bound"]
    manifest = rel.read_manifest(tmp_path)
    entry = manifest["notebooks"]["00_quickstart"]
    assert manifest["preset"] == "default" and entry["status"] == "finished" and entry["error"] is None
    assert entry["fingerprint"] == rel.notebook_inputs(two[0])["fingerprint"]
    assert sorted(entry["outputs"]) == [
        "00_quickstart.ipynb", "figures/00_curves_tag-1.png", "figures/00_curves_tag-1.svg",
        "sweeps/00_study_ctx-128_float32_cpu_w-0123abcd/records.parquet",
        "sweeps/00_study_ctx-128_float32_cpu_w-0123abcd/sweep.json",
        "tables/00_summary_tag-1.csv", "tables/00_summary_tag-1.parquet"]  # no part file, no lock
    run = entry["run"]
    assert run["weights"] == ["0123abcd"] and run["wall_minutes"] >= 0 and run["peak_rss_mib"] is not None
    assert set(run["machine"]) >= {"cpu_model", "cpu_flags", "cpus", "platform"} and "commit" in run
    assert run["threads"]["num_threads"] == 1  # notebook 00's default
    # the image the cell also saved became a link to the saved PNG
    cell = json.loads((tmp_path / "00_quickstart.ipynb").read_text())["cells"][0]
    assert [o.get("output_type") for o in cell["outputs"]] == ["display_data", "stream"]
    assert cell["outputs"][0]["data"]["text/markdown"] == "![00_curves_tag-1](figures/00_curves_tag-1.png)"
    assert cell["outputs"][0]["metadata"]["sur_lab"]["figures"] == ["figures/00_curves_tag-1.png"]
    assert rel.verify(tmp_path) == []
    readme = (tmp_path / "README.md").read_text()
    assert "[claims.md](claims.md)" in readme and "[`00_quickstart`](00_quickstart.ipynb) | finished" in readme
    assert "[00_summary_tag-1.csv](tables/00_summary_tag-1.csv)" in readme
    assert (tmp_path / "claims.md").is_file() and (tmp_path / "claims.csv").is_file()

    # unchanged inputs: nothing runs again
    calls.clear()
    assert rel.release(two, tmp_path, runner=fake_runner(calls), progress=False) == 0
    assert calls == []
    # a source edit (simulated: the stored hash of one input differs): only that notebook runs again
    manifest = rel.read_manifest(tmp_path)
    manifest["notebooks"]["01_theory_bound"]["inputs"]["files"]["sur_lab/budget.py"] = "0" * 16
    rel.write_manifest(tmp_path, manifest)
    [c0, c1] = rel.check(tmp_path, two)
    assert (c0.status, c1.status) == ("fresh", "stale") and c1.reasons == ("changed: sur_lab/budget.py",)
    assert rel.release(two, tmp_path, runner=fake_runner(calls), progress=False) == 0
    assert calls == ["01_theory_bound"]
    # --force runs a fresh notebook; a figure of an earlier run with other parameters is removed after it finishes
    (tmp_path / "figures" / "00_curves_tag-0.png").write_bytes(PNG)
    os.utime(tmp_path / "figures" / "00_curves_tag-0.png", (1e9, 1e9))  # written by an earlier run
    calls.clear()
    assert rel.release(two[:1], tmp_path, runner=fake_runner(calls), progress=False, force=True) == 0
    assert calls == ["00_quickstart"] and not (tmp_path / "figures" / "00_curves_tag-0.png").exists()
    assert rel.verify(tmp_path) == []


def test_failures_and_interruptions_are_recorded(tmp_path, two):
    calls: list = []
    assert rel.release(two, tmp_path, runner=fake_runner(calls, fail={"00_quickstart"}), progress=False) == 1
    assert calls == ["00_quickstart", "01_theory_bound"]  # a failure does not stop the release
    entries = rel.read_manifest(tmp_path)["notebooks"]
    assert entries["00_quickstart"]["status"] == "failed"
    assert entries["00_quickstart"]["error"] == "RuntimeError: cell 3 raised ValueError: boom"
    assert entries["01_theory_bound"]["status"] == "finished"
    [c0, _] = rel.check(tmp_path, two)
    assert c0.status == "failed" and "boom" in c0.reasons[0]
    calls.clear()
    assert rel.release(two, tmp_path, runner=fake_runner(calls, interrupt={"00_quickstart"}), progress=False) == 130
    assert calls == ["00_quickstart"]  # the release stops at an interruption
    assert rel.read_manifest(tmp_path)["notebooks"]["00_quickstart"]["error"].startswith("interrupted")
    calls.clear()
    assert rel.release(two, tmp_path, runner=fake_runner(calls), progress=False) == 0
    assert calls == ["00_quickstart"]  # resumed: 01 had finished
    assert rel.verify(tmp_path) == []


def test_check_reports_missing_and_orphans(tmp_path, two, capsys):
    rel.release(two[:1], tmp_path, runner=fake_runner([]), progress=False)
    manifest = rel.read_manifest(tmp_path)
    manifest["notebooks"]["99_gone"] = {"status": "finished", "outputs": {}}
    rel.write_manifest(tmp_path, manifest)
    checks = {c.notebook: c for c in rel.check(tmp_path)}
    assert checks["00_quickstart"].status == "fresh"
    assert all(checks[p.stem].status == "missing" for p in notebooks("*")[1:])
    assert checks["99_gone"].status == "orphan"
    report = rel.check_report(list(checks.values()))
    assert f"1 fresh, 0 stale, {len(notebooks('*')) - 1} missing, 1 orphan" in report
    assert f"would run {len(notebooks('*')) - 1}" in report
    (tmp_path / "00_quickstart.ipynb").unlink()
    assert rel.check(tmp_path, two[:1])[0].reasons == ("00_quickstart.ipynb is gone",)
    # --check exits 0 on missing and stale results; 1 only when results/ does not match its manifest
    shutil.copy(tmp_path / "claims.md", tmp_path / "00_quickstart.ipynb")
    assert rel.main(["--check", "--results", str(tmp_path), "--only", "00"]) == 1
    assert "does not match its manifest" in capsys.readouterr().err


def test_verify_finds_a_tampered_folder(tmp_path, two):
    rel.release(two, tmp_path, runner=fake_runner([]), progress=False)
    assert rel.main(["--verify", "--results", str(tmp_path)]) == 0
    assert rel.main(["--check", "--results", str(tmp_path), "--only", "00", "01"]) == 0
    csv = tmp_path / "tables" / "01_summary_tag-1.csv"
    csv.write_text(csv.read_text().replace("1.0", "0.9"))
    (tmp_path / "figures" / "00_extra.png").write_bytes(PNG)
    (tmp_path / "figures" / "00_curves_tag-1.svg").unlink()
    (tmp_path / "sweeps" / "01_study_ctx-128_float32_cpu_w-0123abcd" / "parts" / "x.jsonl").write_text("junk")
    problems = rel.verify(tmp_path)
    assert problems == ["00_quickstart: figures/00_curves_tag-1.svg is listed in the manifest but missing",
                        "00_quickstart: figures/00_extra.png is not listed in the manifest",
                        "01_theory_bound: tables/01_summary_tag-1.csv differs from the manifest (size or sha256)"]
    assert rel.main(["--verify", "--results", str(tmp_path)]) == 1
    # a file that matches its manifest entry but does not parse
    parquet = tmp_path / "tables" / "01_summary_tag-1.parquet"
    parquet.write_bytes(b"not parquet")
    manifest = rel.read_manifest(tmp_path)
    manifest["notebooks"]["01_theory_bound"]["outputs"]["tables/01_summary_tag-1.parquet"] = rel.file_facts(parquet)
    rel.write_manifest(tmp_path, manifest)
    assert any(p.startswith("01_theory_bound: tables/01_summary_tag-1.parquet does not parse") for p in
               rel.verify(tmp_path))
    (tmp_path / "manifest.json").write_text("{not json")
    assert rel.verify(tmp_path)[0].endswith("not valid JSON (Expecting property name enclosed in double quotes: "
                                            "line 1 column 2 (char 1))")
    assert rel.verify(tmp_path / "nothing_yet") == []


def test_arguments_and_presets(tmp_path, two, capsys):
    assert rel.main(["--only", "zz"]) == 2
    assert "--only 'zz' matches no notebook" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--preset 'smoke'"):
        rel.release(two, rel.RESULTS_DIR, preset="smoke", runner=fake_runner([]), progress=False)
    rel.release(two[:1], tmp_path, preset="smoke", runner=fake_runner([]), progress=False)
    manifest = rel.read_manifest(tmp_path)
    assert manifest["preset"] == "smoke"
    assert manifest["notebooks"]["00_quickstart"]["parameters"] == {"budgets": [5], "max_new_tokens": 8}
    assert rel.check(tmp_path, two[:1])[0].status == "fresh"  # checked at the folder's preset
    with pytest.raises(ValueError, match="holds a 'smoke' release"):
        rel.release(two[:1], tmp_path, preset="default", runner=fake_runner([]), progress=False)
    assert rel.main(["--index", "--results", str(tmp_path)]) == 0
    assert "A smoke release" in (tmp_path / "README.md").read_text()


def test_link_figures_and_sweep_progress(tmp_path):
    assert rel._figure_names('save_figure(fig, f"02_models_{e}", tag=tag)\nsave_figure(g, "02_x")') == [
        r"02_models_.+?", "02_x"]
    nb = nbformat.v4.new_notebook()
    image = nbformat.v4.new_output("display_data", data={"image/png": "iVBO", "text/plain": "<Figure>"})
    for source in ('save_figure(fig, "01_bound", tag=tag)', 'save_figure(fig, "01_bound_rows", tag=tag)',
                   'for e in ["em", "agree"]:\n    save_figure(fig, f"02_models_{e}")', 'plt.show()'):
        cell = nbformat.v4.new_code_cell(source)
        cell.outputs = [image, image] if "for e" in source else [image]
        nb.cells.append(cell)
    nbformat.write(nb, tmp_path / "x.ipynb")
    figs = [tmp_path / "figures" / f"{s}.png" for s in ("01_bound_n-4", "01_bound_rows_n-4", "02_models_em",
                                                         "02_models_agree")]
    assert rel.link_figures(tmp_path / "x.ipynb", tmp_path, figs) == 4  # the plain plt.show() keeps its image
    cells = json.loads((tmp_path / "x.ipynb").read_text())["cells"]
    assert [c["outputs"][0]["metadata"].get("sur_lab", {}).get("figures") for c in cells] == [
        ["figures/01_bound_n-4.png"], ["figures/01_bound_rows_n-4.png"],
        ["figures/02_models_agree.png", "figures/02_models_em.png"], None]
    assert [len(c["outputs"]) for c in cells] == [1, 1, 1, 1]
    folder = tmp_path / "sweeps" / "02_niah_a"
    (folder / "parts").mkdir(parents=True)
    assert rel.sweep_progress(folder) == (0, None)
    (folder / "sweep.json").write_text(json.dumps({"records_planned": 12}))
    (folder / "parts" / "a.jsonl").write_text("{}\n{}\n{")  # the torn last line does not count
    (folder / "parts" / "b.jsonl").write_text("{}\n")
    assert rel.sweep_progress(folder) == (3, 12)


def test_format_minutes():
    assert [rel.format_minutes(m) for m in (None, 0.5, 12.2, 125)] == ["–", "30 s", "12 min", "2 h 05 min"]


@pytest.mark.slow
def test_a_smoke_release_of_notebook_00(tmp_path):
    """One real notebook, at its smoke parameters: figures land as PNG and SVG, tables as CSV and Parquet, the
    executed copy links its saved figures instead of embedding them, and the folder verifies."""
    [path] = notebooks("00")
    assert rel.release([path], tmp_path, preset="smoke", progress=False) == 0
    entry = rel.read_manifest(tmp_path)["notebooks"]["00_quickstart"]
    outs = list(entry["outputs"])
    assert any(o.endswith(".svg") for o in outs) and not any(o.endswith(".pdf") for o in outs)
    assert any(o.startswith("tables/") and o.endswith(".parquet") for o in outs)
    nb = json.loads((tmp_path / "00_quickstart.ipynb").read_text())
    images = [o for c in nb["cells"] for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    links = [o for c in nb["cells"] for o in c.get("outputs", []) if "sur_lab" in o.get("metadata", {})]
    assert not images and len(links) == 2
    assert entry["run"]["peak_rss_mib"] > 100  # the kernel loaded a model
    assert rel.verify(tmp_path) == [] and rel.check(tmp_path, [path])[0].status == "fresh"


def test_run_watch_samples_memory_and_sweeps(tmp_path):
    pytest.importorskip("psutil")
    folder = tmp_path / "sweeps" / "02_niah_a"
    code = "import sys, time; x = b'x' * (200 * 2**20); print(1, flush=True); time.sleep(30)"
    with rel.RunWatch(tmp_path, "02_allocation_geometry", expected_minutes=2.0, progress=True,
                      interval=600) as watch:
        (folder / "parts").mkdir(parents=True)
        (folder / "sweep.json").write_text(json.dumps({"records_planned": 10}))
        (folder / "parts" / "a.jsonl").write_text("{}\n" * 3)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        try:
            proc.stdout.readline()  # the child holds its 200 MiB
            watch.sample()
        finally:
            proc.kill()
            proc.wait()
        bar = watch._bars["02_niah_a"]
        assert (bar.n, bar.total) == (3, 10)
    assert watch.peak_rss_mib > 150  # the child's resident memory was seen


def test_figure_and_table_formats_follow_the_environment(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    from PIL import Image

    from sur_lab.analysis import plotting

    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [0, 1])
    assert [p.suffix for p in plotting.save_figure(fig, "f", outputs=tmp_path)] == [".png", ".pdf"]  # the default
    monkeypatch.setenv(plotting.FIGURE_FORMATS_ENV, "png,svg")
    monkeypatch.setenv(plotting.FIGURE_DPI_ENV, "50")
    with matplotlib.rc_context({"savefig.bbox": "standard"}):  # the house style's tight box would trim the size
        png, svg = plotting.save_figure(fig, "g", outputs=tmp_path)
    assert svg.suffix == ".svg" and svg.read_text().lstrip().startswith("<?xml")
    assert Image.open(png).size == (100, 50)  # 2 x 1 inches at 50 dpi
    monkeypatch.setenv(plotting.FIGURE_DPI_ENV, "0")
    with pytest.raises(ValueError, match="SUR_LAB_FIGURE_DPI='0'"):
        plotting.save_figure(fig, "h", outputs=tmp_path)
    monkeypatch.setenv(plotting.FIGURE_FORMATS_ENV, "png,eps")
    with pytest.raises(ValueError, match="SUR_LAB_FIGURE_FORMATS='png,eps'"):
        plotting.save_figure(fig, "h", outputs=tmp_path)
    assert not list(tmp_path.glob("figures/h.*"))
    plt.close(fig)
    monkeypatch.setenv(plotting.TABLE_FORMATS_ENV, "csv,parquet")
    csv, parquet = plotting.save_table(pd.DataFrame({"a": [1]}), "t", outputs=tmp_path)
    assert pd.read_parquet(parquet).equals(pd.read_csv(csv))


def test_runs_from_several_machines_are_labelled_and_subtotalled():
    xeon = {"cpu_model": "Xeon", "cpus": 2, "cpu_flags": ["avx512_bf16"], "torch_cpu_capability": "AVX512"}
    epyc = {"cpu_model": "EPYC", "cpus": 2, "cpu_flags": [], "torch_cpu_capability": "AVX512"}
    entries = {"00_a": {"status": "finished", "run": {"wall_minutes": 10.0, "machine": xeon}},
               "01_b": {"status": "finished", "run": {"wall_minutes": 30.0, "machine": epyc}},
               "02_c": {"status": "finished", "run": {"wall_minutes": 5.0, "machine": dict(xeon)}},
               "03_d": {"status": "failed", "run": {"wall_minutes": 99.0, "machine": epyc}},
               "04_e": {"status": "finished", "run": {"wall_minutes": 1.0}}}
    labels, machines = rel.machine_labels(entries)
    assert labels == {"00_a": "M1", "01_b": "M2", "02_c": "M1", "03_d": "M2"}  # one label per distinct stamp
    assert machines == {"M1": "Xeon (2 CPUs; flags avx512_bf16; torch CPU capability AVX512)",
                        "M2": "EPYC (2 CPUs; flags none recorded; torch CPU capability AVX512)"}
    line = rel.wall_time_line(entries, sorted(entries))  # the failed run counts nowhere
    assert line == ("Total wall time of the 4 finished notebooks: 46 min. The runs came from 2 machines (M1 15 min, "
                    "M2 30 min, unrecorded 1 min): the sum is not one machine's time.")
    one = {k: v for k, v in entries.items() if k in ("00_a", "02_c")}
    assert rel.wall_time_line(one, sorted(one)) == "Total wall time of the 2 finished notebooks: 15 min."
    assert rel.wall_time_line({}, []) == "No notebook has finished in this release yet."


def test_the_index_names_each_runs_machine_when_there_are_several(tmp_path):
    xeon = {"cpu_model": "Xeon", "cpus": 2, "cpu_flags": [], "torch_cpu_capability": "AVX512"}
    epyc = dict(xeon, cpu_model="EPYC")
    run = {"wall_minutes": 2.0, "finished": "2026-12-07T10:00:00", "commit": "abc"}
    manifest = {"schema": 1, "preset": "default", "notebooks": {
        "00_quickstart": {"status": "finished", "run": dict(run, machine=xeon)},
        "01_theory_bound": {"status": "finished", "run": dict(run, machine=epyc)}}}
    text = rel.index_markdown(tmp_path, manifest)
    assert "| notebook | status | wall time | peak memory | finished | commit | machine |" in text
    assert "| M1 |" in text and "| M2 |" in text
    assert "Machine M1: Xeon (2 CPUs" in text and "Machine M2: EPYC (2 CPUs" in text
    assert "The runs came from 2 machines (M1 2 min, M2 2 min)" in text
    manifest["notebooks"]["01_theory_bound"]["run"]["machine"] = xeon
    text = rel.index_markdown(tmp_path, manifest)
    assert "| machine |" not in text and "Machine: Xeon (2 CPUs" in text and "came from" not in text
