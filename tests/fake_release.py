"""A fake notebook runner for the results release's tests (``tests/test_release.py``, ``tests/test_results_page.py``):
it writes what a notebook run writes, without running anything."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import nbformat
import pandas as pd

PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")
SVG = '<svg xmlns="http://www.w3.org/2000/svg" width="1" height="1"></svg>\n'


def fake_runner(calls: list, *, fail: set = frozenset(), interrupt: set = frozenset()):
    """A runner that writes what a notebook run writes: an executed copy whose one cell saved and showed a figure,
    the figure (PNG, SVG), a table (CSV, Parquet) and a sweep folder (records, sweep.json, a part file, a lock)."""

    def run(path, parameters, *, outputs, progress=True):
        calls.append(path.stem)
        if path.stem in interrupt:
            raise KeyboardInterrupt("interrupted by signal SIGTERM")
        if path.stem in fail:
            raise RuntimeError("cell 3 raised ValueError: boom")
        n = path.stem[:2]
        out = Path(outputs)
        for sub in ("figures", "tables"):
            (out / sub).mkdir(parents=True, exist_ok=True)
        (out / "figures" / f"{n}_curves_tag-1.png").write_bytes(PNG)
        (out / "figures" / f"{n}_curves_tag-1.svg").write_text(SVG)
        df = pd.DataFrame({"method": ["SUR", "Shift"], "em": [1.0, 0.0]})
        df.to_csv(out / "tables" / f"{n}_summary_tag-1.csv", index=False)
        df.to_parquet(out / "tables" / f"{n}_summary_tag-1.parquet", index=False)
        sweep = out / "sweeps" / f"{n}_study_ctx-128_float32_cpu_w-0123abcd"
        (sweep / "parts").mkdir(parents=True, exist_ok=True)
        df.to_parquet(sweep / "records.parquet", index=False)
        (sweep / "sweep.json").write_text(json.dumps({"records_planned": 2}))
        (sweep / "parts" / "case-1.jsonl").write_text("{}\n{}\n")
        (sweep / ".sweep.lock").write_text("")
        nb = nbformat.v4.new_notebook()
        cell = nbformat.v4.new_code_cell(f'fig = plot()\nsave_figure(fig, "{n}_curves", tag=tag)')
        cell.outputs = [nbformat.v4.new_output("display_data", data={"image/png": base64.b64encode(PNG).decode(),
                                                                        "text/plain": "<Figure>"}),
                        nbformat.v4.new_output("stream", name="stdout", text="done\n")]
        nb.cells.append(cell)
        nbformat.write(nb, out / f"{path.stem}.ipynb")
        return out / f"{path.stem}.ipynb"

    return run
