"""The documentation's measured-times page, generated from executed notebooks' own records (never typed by hand).

Each executed copy that :func:`sur_lab.runtime.run_notebooks.run_notebook` writes carries papermill's records (the
injected parameters, start and end times, the wall time of the whole run and of every cell) and the runner's stamp
``metadata.sur_lab.run`` (CPU count, platform, Python and torch versions). This module turns a folder of such copies
into one Markdown page: per run folder, one row per notebook with the suite it belongs to (smoke, default or custom
parameters), the model, the wall time and the slowest cell, and the failed runs with their error. ``make docs`` builds
it into the site as ``results.md`` (``docs/hooks.py``); from the shell::

    python -m sur_lab.runtime.results_page outputs/ > results.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

HEADER = """# Measured times

Generated from the executed notebooks' own records (papermill's timings and the runner's machine stamp) when the
site was built; nothing on this page is typed by hand. Timings depend on the machine and on what else ran on it, so
read them as one run's wall times, not as benchmarks; the benchmarks are notebooks 04 and 05 and the scripts in
[Executors and performance](executors.md). The *load* column is the machine's 1-minute load average when each run
finished: a load above the CPU count means that other work shared the cores.
"""


def format_seconds(seconds: float | None) -> str:
    """``"4 s"``, ``"2 min 05 s"``, ``"1 h 03 min"``; ``"–"`` for None."""
    if seconds is None:
        return "–"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, sec = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _declared_defaults(nb: dict) -> dict:
    """Literal defaults of the notebook's tagged ``parameters`` cell (papermill keeps it in the executed copy)."""
    import ast

    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            source = "".join(cell.get("source", []))
            out = {}
            for node in ast.parse(source).body:
                target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
                if isinstance(target, ast.Name) and getattr(node, "value", None) is not None:
                    try:
                        out[target.id] = ast.literal_eval(node.value)
                    except ValueError:
                        pass
            return out
    return {}


def _model_label(name) -> str:
    from sur_lab.models import embedded_model

    embedded = embedded_model(name if name else None)
    return embedded.label if embedded is not None else str(name)


def _suite(nb: dict, injected: dict) -> str:
    meta = nb.get("metadata", {}).get("sur_lab", {})
    smoke = meta.get("smoke_parameters", {})
    suite = meta.get("suite_parameters", {})
    if smoke and injected == smoke:
        return "smoke"
    if injected == suite or not injected:
        return "default"
    return "custom"


def notebook_record(path: Path) -> dict:
    """What one executed copy (``<name>.ipynb``) or failed copy (``<name>.failed.ipynb``) says about its run.

    Returns:
        ``notebook, suite, model, parameters`` (the injected ones, as text), ``status`` ("ok" or "failed"),
        ``wall_s`` (papermill's duration, seconds; None when absent), ``slowest_cell`` (its first line) and
        ``slowest_s``, ``finished`` (ISO time), ``error`` (failed runs), ``machine`` (the runner's stamp) and
        ``load`` (the 1-minute load average when the run finished; None when not recorded).
    """
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    meta = nb.get("metadata", {})
    pm = meta.get("papermill", {})
    injected = dict(pm.get("parameters") or {})
    defaults = _declared_defaults(nb)
    model = injected.get("model_name", defaults.get("model_name", ""))
    cells = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    timed = [(c.get("metadata", {}).get("papermill", {}).get("duration"), c) for c in cells]
    timed = [(d, c) for d, c in timed if isinstance(d, (int, float))]
    slowest = max(timed, key=lambda t: t[0], default=(None, None))
    first_line = ""
    if slowest[1] is not None:
        lines = [ln for ln in "".join(slowest[1].get("source", [])).splitlines() if ln.strip()]
        first_line = lines[0][:60] if lines else ""
    failed = path.name.endswith(".failed.ipynb")
    return {
        "notebook": path.name.removesuffix(".failed.ipynb").removesuffix(".ipynb"),
        "suite": _suite(nb, injected),
        "model": _model_label(model) if "model_name" in defaults or "model_name" in injected else "–",
        "parameters": ", ".join(f"{k}={v!r}" for k, v in injected.items()) or "(defaults)",
        "status": "failed" if failed else "ok",
        "wall_s": pm.get("duration"),
        "slowest_cell": first_line,
        "slowest_s": slowest[0],
        "finished": pm.get("end_time"),
        "error": meta.get("sur_lab", {}).get("run_error", ""),
        "machine": {k: v for k, v in meta.get("sur_lab", {}).get("run", {}).items() if k != "load_1min"},
        "load": meta.get("sur_lab", {}).get("run", {}).get("load_1min"),
    }


def folder_records(folder: Path) -> list[dict]:
    """:func:`notebook_record` of every executed or failed copy in ``folder``, by notebook name (empty if none)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    paths = sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))
    return [notebook_record(p) for p in paths]


def _machine_line(records: list[dict]) -> str:
    stamps = {json.dumps(r["machine"], sort_keys=True) for r in records if r["machine"]}
    if not stamps:
        return "Machine: not recorded (copies written before the runner stamped its machine)."
    parts = []
    for stamp in sorted(stamps):
        m = json.loads(stamp)
        parts.append(f"{m.get('cpus', '?')} CPUs, {m.get('platform', '?')}, Python {m.get('python', '?')}, "
                     f"torch {m.get('torch', '?')}")
    return "Machine: " + "; ".join(parts) + "."


def folder_markdown(title: str, records: list[dict]) -> str:
    """One section: the notebooks' table, the total wall time of the runs that finished, and the failed runs."""
    ok = [r for r in records if r["status"] == "ok"]
    failed = [r for r in records if r["status"] == "failed"]
    lines = [f"## {title}", "", _machine_line(records), ""]
    if any(r["suite"] == "smoke" for r in records):
        from sur_lab.studies.presets import SMOKE_BANNER

        lines += [f"Smoke runs are a plumbing check ({SMOKE_BANNER.removeprefix('plumbing check: ')}): they show "
                  "that every notebook runs; their verdicts and numbers are not results. The default suite (`make "
                  "notebooks`) runs the studies.", ""]
    if ok:
        lines += ["| notebook | suite | model | wall time | finished | load |", "|---|---|---|---|---|---|"]
        for r in ok:
            finished = (r["finished"] or "")[:16].replace("T", " ") or "–"
            load = "–" if r["load"] is None else f"{r['load']:g}"
            lines.append(f"| `{r['notebook']}` | {r['suite']} | {r['model']} | {format_seconds(r['wall_s'])} | "
                         f"{finished} | {load} |")
        total = sum(r["wall_s"] or 0.0 for r in ok)
        lines += ["", f"Total wall time of the {len(ok)} finished notebooks: {format_seconds(total)}.", "",
                  "Parameters given to each run (beside the notebook's defaults) and its slowest cell:", ""]
        for r in ok:
            cell = f"; slowest cell `{r['slowest_cell']}` ({format_seconds(r['slowest_s'])})" if r["slowest_cell"] else ""
            lines.append(f"- `{r['notebook']}`: {r['parameters']}{cell}")
    if failed:
        lines += ["", "Failed or interrupted runs (their last good copy, if any, is in the table above):", ""]
        lines += [f"- `{r['notebook']}`: {r['error'] or 'no error recorded'}" for r in failed]
    return "\n".join(lines) + "\n"


def results_markdown(*folders: Path | None, titles: Iterable[str] | None = None) -> str:
    """The whole page for the given run folders (None and repeated folders are skipped).

    Args:
        folders: folders of executed copies (e.g. the docs build's smoke run, then ``outputs/``).
        titles: section titles, one per folder (default: "Run in <folder name>").

    Returns:
        Markdown text; without any executed copy it says how to produce one.
    """
    titles = list(titles) if titles is not None else [None] * len(folders)
    if len(titles) != len(folders):
        raise ValueError(f"titles has {len(titles)} entries for {len(folders)} folders")
    sections, seen = [], set()
    for folder, title in zip(folders, titles):
        if folder is None:
            continue
        folder = Path(folder).resolve()
        if folder in seen:
            continue
        seen.add(folder)
        records = folder_records(folder)
        if records:
            suites = sorted({r["suite"] for r in records})
            sections.append(folder_markdown(title or f"{', '.join(suites).capitalize()} run in `{folder.name}/`",
                                            records))
    if not sections:
        sections.append("No executed notebook was found when this site was built. `make docs` runs the smoke suite "
                        "and builds the site from it; `make notebooks` runs the default suite into `outputs/`, "
                        "which later builds include.\n")
    stamp = datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return HEADER + f"\nPage generated {stamp}.\n\n" + "\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="folders of executed notebooks")
    args = parser.parse_args(argv)
    missing = [f for f in args.folders if not f.is_dir()]
    if missing:
        print(f"folders: {missing[0]} is not a folder", file=sys.stderr)
        return 2
    sys.stdout.write(results_markdown(*args.folders))
    return 0


if __name__ == "__main__":
    sys.exit(main())
