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
