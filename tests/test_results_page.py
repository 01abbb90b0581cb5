"""The measured-times page is generated from executed notebooks' records: papermill's durations, the injected
parameters (smoke / default / custom), the runner's machine stamp and failed runs."""

from __future__ import annotations

import nbformat
import pytest

from sur_lab.runtime.results_page import folder_records, format_seconds, main, results_markdown


def executed(path, *, injected, duration, smoke=None, error=None, cells=((1.5, "x = 1"), (7.25, "slow_step()"))):
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('model_name: str = ""  # the model\nbudgets: list = [2, 5]')
    params.metadata["tags"] = ["parameters"]
    nb.cells.append(params)
    for seconds, source in cells:
        cell = nbformat.v4.new_code_cell(source)
        cell.metadata["papermill"] = {"duration": seconds}
        nb.cells.append(cell)
    nb.metadata["papermill"] = {"parameters": injected, "duration": duration, "end_time": "2030-01-02T03:04:05.6"}
    nb.metadata["sur_lab"] = {"smoke_parameters": smoke or {"budgets": [5]},
                              "run": {"cpus": 4, "platform": "Linux-x", "python": "3.11", "torch": "2.13",
                                      "load_1min": 0.5}}
    if error:
        nb.metadata["sur_lab"]["run_error"] = error
    nbformat.write(nb, path)


def test_records_and_page(tmp_path):
    executed(tmp_path / "00_a.ipynb", injected={"budgets": [5]}, duration=65.0)
    executed(tmp_path / "01_b.ipynb", injected={}, duration=4000.0)
    executed(tmp_path / "02_c.ipynb", injected={"model_name": "qwen2.5-coder-0.5b"}, duration=3.0)
    executed(tmp_path / "03_d.failed.ipynb", injected={}, duration=None, error="failed: ValueError: boom")
    (tmp_path / ".00_a.lock").write_text("")
    records = {r["notebook"]: r for r in folder_records(tmp_path)}
    assert [records[n]["suite"] for n in ("00_a", "01_b", "02_c")] == ["smoke", "default", "custom"]
    assert records["00_a"]["model"] == "SmolLM2-135M-Instruct"  # the parameters cell's default ""
    assert records["02_c"]["model"] == "Qwen2.5-Coder-0.5B-Instruct"
    assert records["00_a"]["slowest_cell"] == "slow_step()" and records["00_a"]["slowest_s"] == 7.25
    assert records["03_d"]["status"] == "failed" and records["03_d"]["wall_s"] is None
    page = results_markdown(tmp_path, tmp_path, None)  # repeated and missing folders are skipped
    assert page.count("## ") == 1 and page.count("| `0") == 3
    assert "| 1 min 05 s |" in page and "| 1 h 06 min |" in page and "4 CPUs, Linux-x" in page
    assert "Total wall time of the 3 finished notebooks: 1 h 07 min." in page
    assert "`03_d`: failed: ValueError: boom" in page
    assert "plumbing check (sizes too small to decide anything)" in page  # 00_a ran at smoke
    (tmp_path / "00_a.ipynb").unlink()
    assert "plumbing check" not in results_markdown(tmp_path)  # no smoke run, no banner
    assert "No executed notebook" in results_markdown(tmp_path / "empty")


def test_format_seconds_and_cli(tmp_path, capsys):
    assert [format_seconds(s) for s in (None, 4.4, 125, 3780)] == ["–", "4 s", "2 min 05 s", "1 h 03 min"]
    executed(tmp_path / "00_a.ipynb", injected={}, duration=1.0)
    assert main([str(tmp_path)]) == 0 and "`00_a`" in capsys.readouterr().out
    assert main([str(tmp_path / "missing")]) == 2
    with pytest.raises(ValueError, match="titles"):
        results_markdown(tmp_path, titles=["a", "b"])


def test_release_pages_render_a_results_folder(tmp_path):
    """The site's Results section from a (fake) release: the claims table first, the runs against the current code,
    each notebook's figures and tables, and a banner naming what changed on a stale result."""
    from fake_release import fake_runner

    from sur_lab.runtime import release as rel
    from sur_lab.runtime.claims import CLAIMS
    from sur_lab.runtime.results_page import SITE_PREFIX, release_pages
    from sur_lab.runtime.run_notebooks import notebooks

    two = notebooks("00") + notebooks("01")
    assert rel.release(two, tmp_path, runner=fake_runner([]), progress=False) == 0
    manifest = rel.read_manifest(tmp_path)
    manifest["notebooks"]["01_theory_bound"]["inputs"]["files"]["sur_lab/budget.py"] = "0" * 16  # a source edit
    rel.write_manifest(tmp_path, manifest)
    pages, assets = release_pages(tmp_path)
    assert set(pages) == {f"{SITE_PREFIX}/index.md"} | {f"{SITE_PREFIX}/{p.stem}.md" for p in notebooks("*")}
    index = pages[f"{SITE_PREFIX}/index.md"]
    assert index.index("## Claims") < index.index("## Runs")
    assert all(f"| {c.id} |" in index for c in CLAIMS) and "[`02`](02_allocation_geometry.md)" in index
    assert "| [`00_quickstart`](00_quickstart.md) | fresh |" in index
    assert "| [`01_theory_bound`](01_theory_bound.md) | stale |" in index
    assert '!!! warning "Stale results"' in index and "[`01_theory_bound`](01_theory_bound.md) changed" in index
    stale = pages[f"{SITE_PREFIX}/01_theory_bound.md"]
    assert stale.startswith("# 01 Theory bound\n\n!!! warning \"Stale") and "    - changed: sur_lab/budget.py" in stale
    fresh = pages[f"{SITE_PREFIX}/00_quickstart.md"]
    assert "!!!" not in fresh.split("## Figures")[0].split("??? info")[0]
    assert "### 00_curves\n\n![00_curves](figures/00_curves_tag-1.png)" in fresh
    assert "| method | em |\n|---|---|\n| SUR | 1 |\n| Shift | 0 |" in fresh
    assert "`results/sweeps/00_study_ctx-128_float32_cpu_w-0123abcd/records.parquet`: 2 rows" in fresh
    assert "[00_quickstart.ipynb](00_quickstart.ipynb)" in fresh and "| peak memory |" in fresh
    assert "Not in this release yet" in pages[f"{SITE_PREFIX}/02_allocation_geometry.md"]
    assert {k: v.name for k, v in assets.items()} == {
        f"{SITE_PREFIX}/figures/00_curves_tag-1.png": "00_curves_tag-1.png",
        f"{SITE_PREFIX}/figures/01_curves_tag-1.png": "01_curves_tag-1.png",
        f"{SITE_PREFIX}/tables/00_summary_tag-1.csv": "00_summary_tag-1.csv",
        f"{SITE_PREFIX}/tables/01_summary_tag-1.csv": "01_summary_tag-1.csv",
        f"{SITE_PREFIX}/00_quickstart.ipynb": "00_quickstart.ipynb",
        f"{SITE_PREFIX}/01_theory_bound.ipynb": "01_theory_bound.ipynb"}
    assert all(p.is_file() for p in assets.values())
    assert "| machine |" not in index  # one machine: no column
    manifest["notebooks"]["01_theory_bound"]["run"]["machine"] = dict(
        manifest["notebooks"]["00_quickstart"]["run"]["machine"], cpu_model="Another CPU")
    rel.write_manifest(tmp_path, manifest)
    index = release_pages(tmp_path)[0][f"{SITE_PREFIX}/index.md"]
    assert "| finished | machine |" in index and "| M2 |" in index and "- Machine M2: Another CPU (" in index
    assert "The runs came from 2 machines" in index
    # the measured-times page reads the release's executed copies too
    assert "run in `" + tmp_path.name + "/`" in results_markdown(tmp_path)
    (tmp_path / "manifest.json").write_text("[]")
    assert "does not parse" in release_pages(tmp_path)[0][f"{SITE_PREFIX}/index.md"]
