"""Run the notebook suite under papermill: every ``notebooks/*.ipynb`` in name order, executed copies to ``outputs/``.

Usage::

    python -m sur_lab.runtime.run_notebooks                 # default parameters (the README's first command)
    python -m sur_lab.runtime.run_notebooks --smoke         # each notebook's small smoke parameters (metadata)
    python -m sur_lab.runtime.run_notebooks --only 00_* -p max_new_tokens 16

Notebooks are found by glob, not a hand-kept list. Each notebook's smoke parameters live in its own metadata under
``sur_lab.smoke_parameters``. Parameters given with ``-p`` are passed only to notebooks that declare them.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import sys
import time
from pathlib import Path

from sur_lab.runtime.paths import REPO_ROOT, outputs_dir

NOTEBOOK_DIR = REPO_ROOT / "notebooks"


def notebooks(pattern: str = "*") -> list[Path]:
    """Notebooks under ``notebooks/`` whose file name matches ``pattern``, sorted by name."""
    return sorted(p for p in NOTEBOOK_DIR.glob("*.ipynb") if fnmatch.fnmatch(p.name, pattern if "." in pattern else pattern + "*"))


def smoke_parameters(path: Path) -> dict:
    """The ``sur_lab.smoke_parameters`` dict from a notebook's metadata (empty when absent)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    return dict(nb.metadata.get("sur_lab", {}).get("smoke_parameters", {}))


def declared_parameters(path: Path) -> dict:
    """Parameters declared in the notebook's ``parameters`` cell (papermill's inspection)."""
    import papermill as pm

    return pm.inspect_notebook(str(path))


def run_notebook(path: Path, parameters: dict | None = None, *, outputs: Path | None = None, progress: bool = True) -> Path:
    """Execute one notebook with papermill; the executed copy goes to ``outputs/<name>.ipynb``.

    Raises:
        papermill.PapermillExecutionError: when a cell fails (the executed copy still shows where).
    """
    import papermill as pm

    out_dir = outputs or outputs_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / path.name
    pm.execute_notebook(
        str(path), str(target), parameters=parameters or {}, cwd=str(path.parent), kernel_name="python3",
        progress_bar=progress,
    )
    return target


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="*", help="glob on notebook file names (default: all)")
    parser.add_argument("--smoke", action="store_true", help="use each notebook's smoke parameters")
    parser.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"), help="parameter override")
    args = parser.parse_args(argv)
    overrides = {k: _literal(v) for k, v in args.p}
    paths = notebooks(args.only)
    if not paths:
        print(f"no notebook matches {args.only!r} in {NOTEBOOK_DIR}", file=sys.stderr)
        return 2
    failures = []
    for path in paths:
        declared = declared_parameters(path)
        params = smoke_parameters(path) if args.smoke else {}
        params.update({k: v for k, v in overrides.items() if k in declared})
        print(f"== {path.name} {params or '(defaults)'}", flush=True)
        t0 = time.perf_counter()
        try:
            target = run_notebook(path, params)
            print(f"   ok in {time.perf_counter() - t0:.0f} s -> {target}", flush=True)
        except Exception as err:  # keep going: one failing notebook should not hide the others' results
            failures.append(path.name)
            print(f"   FAILED after {time.perf_counter() - t0:.0f} s: {type(err).__name__}: {err}", flush=True)
    print(f"{len(paths) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
