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
import math
import sys
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from sur_lab.models import embedded_model
from sur_lab.runtime.claims import claim_rows, claims_markdown
from sur_lab.runtime.params import literal_defaults
from sur_lab.runtime.release import (check, format_minutes, machine_labels, manifest_preset, read_manifest,
                                     wall_time_line)
from sur_lab.studies.presets import SMOKE_BANNER

HEADER = """# Measured times

Generated from the executed notebooks' own records (papermill's timings and the runner's machine stamp) when the
site was built; nothing on this page is typed by hand. Timings depend on the machine and on what else ran on it, so
read them as one run's wall times, not as benchmarks; the benchmarks are notebooks 04 and 05 and the scripts in
[Executors and performance](executors.md). The *load* column is the machine's 1-minute load average when each run
finished: a load above the CPU count means that other work shared the cores. The committed release's own times,
peak memory and the machine of each run (a release may be run on several machines) are on the
[Results](release/index.md) page, from its manifest.
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
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            return literal_defaults("".join(cell.get("source", [])))
    return {}


def _model_label(name) -> str:
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


# ---------------------------------------------------------------------------------------------------------------------
# The release's pages: the claims table, each notebook's figures and tables, the run manifest


#: Where the release's pages and files sit in the site (not ``results/``: this module's measured-times page is
#: ``results.md``, which the site serves at ``results/``).
SITE_PREFIX = "release"
#: A table is shown on its page when it has at most this many rows and columns; larger ones are linked only.
TABLE_ROWS, TABLE_COLUMNS = 25, 14


def _cell(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(df, max_rows: int = TABLE_ROWS) -> str:
    """A DataFrame's first ``max_rows`` rows as a Markdown table (numbers to 4 significant digits)."""
    head = df.head(max_rows)
    lines = ["| " + " | ".join(_cell(c) for c in head.columns) + " |", "|" + "---|" * len(head.columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in head.itertuples(index=False)]
    return "\n".join(lines)


def _banner(check) -> list[str]:
    """The admonition at the top of a notebook's results page: stale (naming what changed), failed or not run."""
    if check.status == "stale":
        return ['!!! warning "Stale: the code or inputs changed since this result was computed"', "",
                *[f"    - {why}" for why in check.reasons], "",
                "    Run `sur-lab release` to bring it up to date.", ""]
    if check.status == "failed":
        return ['!!! danger "The last run of this notebook did not finish"', "", f"    {check.reasons[0]}", ""]
    if check.status == "missing":
        why = "; ".join(check.reasons)
        return ['!!! note "Not in this release yet"', "", f"    {why[:1].upper()}{why[1:]}: `sur-lab release` runs it.",
                ""]
    return []


def _title(stem: str) -> str:
    number, _, name = stem.partition("_")
    return f"{number} {name.replace('_', ' ').capitalize()}"


def _name(stem: str) -> str:
    """A figure's or table's name without its run tag (``02_table12`` of ``02_table12_ctx-1024_n-48``): the tag's
    ``key-value`` parts are the ones with a hyphen (:func:`sur_lab.analysis.plotting.run_tag`)."""
    parts = stem.split("_")
    kept = [p for i, p in enumerate(parts) if "-" not in p and all("-" not in q for q in parts[:i])]
    return "_".join(kept) or stem


def release_notebook_page(results: Path, check, preset: str = "default",
                          title: str | None = None) -> tuple[str, dict[str, Path]]:
    """One notebook's results page (Markdown) and the files it shows or links (site path -> file): its banner
    (stale, naming what changed; failed; not run), the run's facts, its figures, its tables (small ones shown, all
    linked), its sweep records and its executed copy. ``title``: the page title (default from the notebook's name)."""
    entry, stem = check.entry, check.notebook
    title = title or _title(stem)
    outs = list(entry.get("outputs", {}))
    assets: dict[str, Path] = {}
    lines = [f"# {title}", "", *_banner(check)]
    if not outs:
        lines += [f"Nothing of `{stem}` is in `results/` yet.", ""]
        return "\n".join(lines), assets
    run = entry.get("run") or {}
    machine = run.get("machine") or {}
    threads = (run.get("threads") or {}).get("num_threads")
    facts = [("status", check.status), ("preset", f"`{preset}`"),
             ("parameters", f"`{json.dumps(entry.get('parameters') or {})}` beside the notebook's defaults"),
             ("wall time", format_minutes(run.get("wall_minutes"))),
             ("peak memory", f"{run['peak_rss_mib']:.0f} MiB ({run.get('peak_rss_source', '')})"
              if run.get("peak_rss_mib") is not None else "–"),
             ("finished", (run.get("finished") or "–").replace("T", " ")),
             ("commit", f"`{(run.get('commit') or '–')[:12]}`"
              + (" (uncommitted changes)" if run.get("dirty") else "")),
             ("machine", f"{machine.get('cpu_model', '?')}, {machine.get('cpus', '?')} CPUs, flags "
              f"{', '.join(machine.get('cpu_flags', [])) or '–'}, torch capability "
              f"{machine.get('torch_cpu_capability')}"),
             ("threads", "torch default (one per core)" if threads == 0 else str(threads)),
             ("model weights", ", ".join(f"`w{w}`" for w in run.get("weights", []))
              or "– (no sweep folder names them)"),
             ("fingerprint", f"`{(entry.get('fingerprint') or '')[:16]}` over "
              f"{len((entry.get('inputs') or {}).get('files', {}))} files")]
    lines += ["| run | |", "|---|---|", *[f"| {k} | {v} |" for k, v in facts], ""]
    files = (entry.get("inputs") or {}).get("files", {})
    if files:
        lines += ['??? info "The files this result depends on"', "",
                  *[f"    - `{f}` (`{h}`)" for f, h in files.items()], ""]
    figures = [r for r in outs if r.startswith("figures/") and r.endswith(".png")]
    if figures:
        lines += ["## Figures", ""]
        for rel in figures:
            assets[rel] = Path(results) / rel
            lines += [f"### {_name(Path(rel).stem)}", "", f"![{_name(Path(rel).stem)}]({rel})", "",
                      f"`{Path(rel).name}` (SVG beside it in `results/`)", ""]
    tables = [r for r in outs if r.startswith("tables/") and r.endswith(".csv")]
    if tables:
        lines += ["## Tables", ""]
        for rel in tables:
            assets[rel] = Path(results) / rel
            df = pd.read_csv(Path(results) / rel)
            lines += [f"### {_name(Path(rel).stem)}", "", f"[`{Path(rel).name}`]({rel}): {len(df)} rows × "
                      f"{len(df.columns)} columns (Parquet beside it in `results/`)", ""]
            if len(df.columns) <= TABLE_COLUMNS and len(df):
                more = f"\n\nFirst {TABLE_ROWS} of {len(df)} rows." if len(df) > TABLE_ROWS else ""
                lines += [markdown_table(df) + more, ""]
    sweeps = [r for r in outs if r.startswith("sweeps/") and r.endswith(".parquet")]
    if sweeps:
        lines += ["## Sweep records", ""]
        lines += [f"- `results/{r}`: {pq.read_metadata(Path(results) / r).num_rows} rows" for r in sweeps]
        lines.append("")
    executed = f"{stem}.ipynb"
    if executed in outs:
        assets[executed] = Path(results) / executed
        lines += ["## Executed notebook", "", f"[{executed}]({executed}) (download; its figures are the files above). "
                  f"The site's notebook page, [{title}](../notebooks/{executed}), shows the notebook as the site's "
                  "build ran it (`make docs`: its smoke run), or its code without outputs (`make docs-release`).", ""]
    return "\n".join(lines), assets


def release_pages(results: Path, titles: Mapping[str, str] | None = None) -> tuple[dict[str, str], dict[str, Path]]:
    """The site's Results section from a results folder: ``({site path: markdown}, {site path: file})``;
    ``titles``: notebook stem -> page title (the site's navigation titles; default from the names).

    ``release/index.md`` holds the claims table (:mod:`sur_lab.runtime.claims`), then the runs: each notebook's status
    against the current code (:func:`sur_lab.runtime.release.check`: fresh, stale, failed, missing), wall time and
    peak memory, and the machine. ``release/<notebook>.md`` holds one notebook's results
    (:func:`release_notebook_page`); a stale one opens with a banner naming what changed.
    """
    results = Path(results)
    try:
        manifest = read_manifest(results)
    except ValueError as err:
        return {f"{SITE_PREFIX}/index.md": f"# Results\n\n!!! danger \"results/ does not parse\"\n\n    {err}\n"}, {}
    preset = manifest_preset(manifest)
    checks = [c for c in check(results) if c.status != "orphan"]
    pages, assets = {}, {}
    for c in checks:
        page, files = release_notebook_page(results, c, preset, (titles or {}).get(c.notebook))
        pages[f"{SITE_PREFIX}/{c.notebook}.md"] = page
        assets.update({f"{SITE_PREFIX}/{k}": v for k, v in files.items()})
    counts = {s: sum(c.status == s for c in checks) for s in ("fresh", "stale", "failed", "missing")}
    lines = ["# Results", "",
             f"Every notebook run at its `{preset}` preset by `sur-lab release` into `results/` (committed with the "
             "repository), read from its manifest when this site was built; nothing here is typed by hand. "
             "Against the current code: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".", ""]
    if preset == "smoke":
        lines += ['!!! warning "A smoke release"', "", "    Plumbing sizes on the small model: it decides nothing.", ""]
    if counts["stale"]:
        stale = ", ".join(f"[`{c.notebook}`]({c.notebook}.md)" for c in checks if c.status == "stale")
        lines += ['!!! warning "Stale results"', "", f"    The code or inputs of {stale} changed since they ran; "
                  "their pages name what changed.", ""]
    rows = claim_rows(results)
    lines += [claims_markdown(rows, link=lambda stem: f"{stem}.md", level=2), ""]
    entries = {c.notebook: c.entry for c in checks}
    labels, machines = machine_labels(entries)
    several = len(machines) > 1
    lines += ["## Runs", "", "| notebook | against the code | wall time | peak memory | finished |"
              + (" machine |" if several else ""), "|---|---|---|---|---|" + ("---|" if several else "")]
    for c in checks:
        run = c.entry.get("run") or {}
        peak = f"{run['peak_rss_mib']:.0f} MiB" if run.get("peak_rss_mib") is not None else "–"
        lines.append(f"| [`{c.notebook}`]({c.notebook}.md) | {c.status} | {format_minutes(c.wall_minutes)} | {peak} | "
                     f"{(run.get('finished') or '–')[:16].replace('T', ' ')} |"
                     + (f" {labels.get(c.notebook, '–')} |" if several else ""))
    lines += ["", wall_time_line(entries, [c.notebook for c in checks])
              + " The executed copies' own timings are on [Measured times](../results.md).", ""]
    if several:
        lines += [f"- Machine {label}: {text}." for label, text in machines.items()] + [""]
    pages[f"{SITE_PREFIX}/index.md"] = "\n".join(lines)
    return pages, assets


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
