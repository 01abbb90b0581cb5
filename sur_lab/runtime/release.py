"""The results release: every notebook run at its ``default`` preset into ``results/``, fingerprinted and indexed.

::

    sur-lab release                  # run every notebook whose inputs changed or that never finished -> results/
    sur-lab release --only 02 09     # only these notebooks (file-name prefixes or globs, as sur-lab run)
    sur-lab release --check          # what is stale against the current code and why; runs nothing (seconds)
    sur-lab release --verify         # does results/ parse and match its manifest? (exit 1 when it does not)
    sur-lab release --index          # rewrite results/README.md and the claims table from the manifest only
    sur-lab release --sizes [SMOKE]  # print what each study cost and can decide (beside a smoke release's sizes)
    make release                     # sur-lab release

**What a result depends on** (:func:`notebook_inputs`, computed without running anything or loading a model): the
source of every ``sur_lab`` module the notebook's code cells import, followed through the modules' own import
statements (every ``import`` and ``from ... import``, also inside functions, resolved to the deepest existing module
as ``tests/test_layout.py`` reads them, plus the packages whose ``__init__`` an import runs and the package files
beside them, such as the one-pass kernel's C++), the notebook's code cells and ``sur_lab`` metadata, the parameters
the release passes (each notebook's ``sur_lab.suite_parameters``), the model (its name and, for an embedded model,
the pinned GGUF sha256), the dtype, the torch, transformers and Python versions and, for a notebook that reads the QA
data, the data's ``SHA256SUMS``. Python sources are compared as syntax trees without docstrings and comments, so an
edit of the prose leaves a result fresh. A notebook whose last run finished with the same fingerprint is not run
again; an interrupted notebook resumes its sweeps from their part files.

**Layout** (committed, except what ``.gitignore`` names: part files, locks, temporary and failed copies)::

    results/README.md                 the generated index (runs, each study's sizes, then each notebook's files)
    results/claims.md, claims.csv     the paper's claims against this release (sur_lab.runtime.claims)
    results/manifest.json             per notebook: status, parameters, inputs and fingerprint, run facts, outputs
    results/<notebook>.ipynb          executed copies; an image that a cell also saved is replaced by a link to it
    results/figures/*.png, *.svg      every figure (PNG and SVG; no PDF)
    results/tables/*.csv, *.parquet   every table, in both formats
    results/sweeps/<folder>/          records.parquet and sweep.json (parts/ stays local: it lets a run resume)

A notebook's outputs are the files under ``figures/``, ``tables/`` and ``sweeps/`` whose names start with its number
(``02_``): the studies name every file so. Each output's size and sha256 are in the manifest, which
:func:`verify` checks (CI runs ``sur-lab release --check``, which includes it).

Exit codes: 0 success (``--check``: also when results are stale or missing), 1 a notebook failed or ``results/`` does
not parse or match its manifest, 2 a bad argument, 130 interrupted (run the same command again to resume).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import nbformat
import pandas as pd
import pyarrow.parquet as pq
import torch
from filelock import FileLock, Timeout
from tqdm import tqdm

from sur_lab.analysis.decisions import effect_text
from sur_lab.analysis.plotting import FIGURE_DPI_ENV, FIGURE_FORMATS_ENV, TABLE_FORMATS_ENV
from sur_lab.fingerprint import digest
from sur_lab.models import embedded_model, resolve_dtype
from sur_lab.paths import REPO_ROOT, atomic_path, default_data_dir
from sur_lab.runtime.claims import write_claims
from sur_lab.runtime.run_notebooks import (
    NOTEBOOK_DIR,
    NotebookBusyError,
    effective_parameters,
    failed_path,
    machine_stamp,
    notebooks,
    run_notebook,
    smoke_parameters,
    suite_parameters,
)
from sur_lab.runtime.sizes import sizes_table

#: The committed results folder.
RESULTS_DIR = REPO_ROOT / "results"
MANIFEST = "manifest.json"
#: Version of the manifest's layout; a manifest of another version is reported by :func:`verify`.
SCHEMA = 1
#: The presets a release runs: ``default`` (the committed results/) and ``smoke`` (a plumbing release elsewhere, e.g.
#: to build the documentation's results pages quickly), each notebook's parameters by preset.
PRESETS = {"default": suite_parameters, "smoke": smoke_parameters}
#: What the release asks of :mod:`sur_lab.analysis.plotting` in every kernel it starts.
FIGURE_FORMATS = "png,svg"
FIGURE_DPI = 110  # the notebooks' display resolution: the SVG keeps the detail, the PNG is for looking at
TABLE_FORMATS = "csv,parquet"
#: Statuses of a notebook in the manifest, and the two more that :func:`check` adds.
STATUSES = ("finished", "failed", "missing")
#: The notebook parameters that name a model, and the one that names the dtype.
MODEL_PARAMETERS = ("model_name", "robustness_model")
#: The module whose presence in a notebook's imports means that it reads the QA data.
DATA_MODULE = "sur_lab.data.qa"
#: CPU flags that change how fast (or whether) a dtype's matrix products run; the manifest keeps these only.
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")
_HASH_BYTES = 8  # 16 hex characters per input file: a change, not a security check


class ReleaseBusyError(RuntimeError):
    """Another release is writing the same results folder."""


# ---------------------------------------------------------------------------------------------------------------------
# What a notebook's result depends on


def _module_path(name: str, root: Path = REPO_ROOT) -> Path | None:
    """The file of module ``name`` (``sur_lab.x.y``) under ``root``: its ``__init__.py`` or ``.py``; None if neither."""
    base = root.joinpath(*name.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


def _imported(tree: ast.AST, package: Sequence[str], root: Path) -> set[str]:
    """The ``sur_lab`` modules the import statements of ``tree`` load, each resolved to the deepest existing module
    (``from sur_lab.x import f`` -> ``sur_lab.x``; ``from sur_lab import x`` -> ``sur_lab.x`` when it is a module), with
    every package above it (importing a module runs its packages' ``__init__``). ``package``: the importing module's
    package, for relative imports."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [f"{mod}.{a.name}" for a in node.names] + [mod]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = _dynamic_imports(node)
        else:
            continue
        for name in names:
            while name and _module_path(name, root) is None:
                name = name.rpartition(".")[0]
            if name == "sur_lab" or name.startswith("sur_lab."):
                parts = name.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return found


def _dynamic_imports(func: ast.AST) -> list[str]:
    """The modules a function imports by name with ``importlib.import_module``: its argument when it is a string, else
    every ``sur_lab...`` string in the function (``for m in ("sur_lab.executors.packed",): import_module(m)``)."""
    calls = [n for n in ast.walk(func) if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(
        n.func, "id", None)) == "import_module" and n.args]
    if not calls:
        return []
    if all(isinstance(c.args[0], ast.Constant) for c in calls):
        return [str(c.args[0].value) for c in calls]
    return [n.value for n in ast.walk(func) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and re.fullmatch(r"sur_lab(\.\w+)+", n.value)]


def _code_cells(nb: Mapping[str, Any]) -> list[str]:
    return ["".join(c.get("source", "")) for c in nb.get("cells", []) if c.get("cell_type") == "code"]


def _cell_tree(source: str) -> ast.AST:
    """A code cell as a syntax tree; IPython magics and shell lines (``%``, ``!``) are dropped first."""
    try:
        return ast.parse(source)
    except SyntaxError:
        lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
        try:
            return ast.parse("\n".join(lines))
        except SyntaxError:  # not Python: read its import lines alone
            return ast.parse("\n".join(ln.strip() for ln in lines if re.match(r"\s*(from|import)\s+sur_lab", ln)))


def study_modules(notebook: Path, root: Path = REPO_ROOT) -> list[str]:
    """Every ``sur_lab`` module a notebook's code cells import, transitively through the modules' own imports.

    Args:
        notebook: the ``.ipynb`` file.
        root: the folder holding the ``sur_lab`` package (the repository root).

    Returns:
        Module names, sorted.
    """
    nb = json.loads(Path(notebook).read_text(encoding="utf-8"))
    todo: set[str] = set()
    for source in _code_cells(nb):
        todo |= _imported(_cell_tree(source), [], root)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo |= _module_facts(_module_path(name, root), root)[0] - seen
    return sorted(seen)


def _module_facts(path: Path, root: Path) -> tuple[frozenset[str], str]:
    """``(the sur_lab modules the file imports, source_hash)`` of a module file, parsed once per file version."""
    stat = path.stat()
    return _module_facts_cached(str(path), str(root), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)
def _module_facts_cached(path: str, root: str, mtime_ns: int, size: int) -> tuple[frozenset[str], str]:
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    name = Path(path).resolve().relative_to(Path(root).resolve()).with_suffix("").parts
    package = list(name[:-1])  # a package's __init__ and a plain module both resolve relative imports from here
    imports = frozenset(_imported(tree, package, Path(root)))
    return imports, _tree_hash(tree)


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            body = getattr(node, name, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                                and isinstance(s.value.value, str))]  # a bare string documents
                setattr(node, name, kept or [ast.Pass()])
    return tree


def _tree_hash(tree: ast.AST) -> str:
    data = ast.dump(_strip_docstrings(tree), annotate_fields=False, include_attributes=False).encode()
    return hashlib.blake2b(data, digest_size=_HASH_BYTES).hexdigest()


def source_hash(path: Path) -> str:
    """A short hash of what a file contributes to results: a Python file's syntax tree without docstrings and bare
    strings (comments are not in the tree), any other file's bytes. 16 hex characters.

    The tree's text differs between Python versions, so hashes are compared only between runs of the same Python
    minor version (:func:`compare_inputs`).
    """
    path = Path(path)
    if path.suffix == ".py":
        return _tree_hash(ast.parse(path.read_text(encoding="utf-8")))
    return hashlib.blake2b(path.read_bytes(), digest_size=_HASH_BYTES).hexdigest()


def notebook_hash(notebook: Path) -> str:
    """A short hash of a notebook's code cells and its ``sur_lab`` metadata (its markdown and outputs are left out:
    prose does not change a result)."""
    nb = json.loads(Path(notebook).read_text(encoding="utf-8"))
    meta = nb.get("metadata", {}).get("sur_lab", {})
    text = json.dumps({"code": [c.rstrip() for c in _code_cells(nb)], "meta": meta}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=_HASH_BYTES).hexdigest()


def input_files(notebook: Path, root: Path = REPO_ROOT) -> dict[str, str]:
    """``{path relative to root: hash}`` of the notebook itself, every module of :func:`study_modules` and the
    non-Python package files beside those modules (e.g. ``executors/kernels/onepass.cpp``)."""
    notebook = Path(notebook)
    out = {_relative(notebook, root): notebook_hash(notebook)}
    folders = set()
    for name in study_modules(notebook, root):
        path = _module_path(name, root)
        out[_relative(path, root)] = _module_facts(path, root)[1]
        folders.add(path.parent)
    for folder in sorted(folders):
        for extra in sorted(folder.iterdir()):
            if extra.is_file() and extra.suffix not in (".py", ".pyc") and not extra.name.startswith("."):
                out[_relative(extra, root)] = source_hash(extra)
    return dict(sorted(out.items()))


def _relative(path: Path, root: Path) -> str:
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return Path(path).as_posix()


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def model_inputs(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{parameter: {"name", "sha256"}}`` for each model parameter (:data:`MODEL_PARAMETERS`) of resolved parameter
    ``values``: an embedded model's label and pinned GGUF sha256 (its weights), another name with ``sha256`` None
    (a hub id or a path: its weights hash is only known once it is loaded, and is recorded after the run). A notebook
    without a model parameter loads the embedded default model."""
    out = {}
    for key in MODEL_PARAMETERS:
        if key not in values or (key != "model_name" and str(values[key]).lower() == "none"):
            continue
        em = embedded_model(values[key] if values[key] is not None else None)
        out[key] = {"name": em.label, "sha256": em.sha256} if em is not None else {"name": str(values[key]),
                                                                                     "sha256": None}
    if not out:
        em = embedded_model(None)
        out["model_name"] = {"name": em.label, "sha256": em.sha256}
    return out


def data_hash() -> str | None:
    """A short hash of the QA data's ``SHA256SUMS`` (every loader verifies its files against it); None when the data
    folder or the file is not found."""
    try:
        sums = default_data_dir() / "SHA256SUMS"
    except FileNotFoundError:
        return None
    return source_hash(sums) if sums.is_file() else None


def notebook_inputs(notebook: Path, parameters: Mapping[str, Any] | None = None, *,
                    root: Path = REPO_ROOT) -> dict[str, Any]:
    """Everything a notebook's release result depends on, and its digest (see the module docstring).

    Args:
        notebook: the ``.ipynb`` file.
        parameters: the parameters the release passes (default: the notebook's ``sur_lab.suite_parameters``).
        root: the repository root the module paths are relative to.

    Returns:
        ``{"fingerprint": 32 hex, "files": {path: hash}, "parameters", "model", "dtype", "versions", "data"}``.
    """
    notebook = Path(notebook)
    params = dict(suite_parameters(notebook) if parameters is None else parameters)
    files = input_files(notebook, root)
    values = effective_parameters(notebook, params)
    data_module = _module_path(DATA_MODULE, root)
    reads_data = data_module is not None and _relative(data_module, root) in files
    fields = {
        "files": files,
        "parameters": params,
        "model": model_inputs(values),
        "dtype": _resolved_dtype(values),
        "versions": {"python": ".".join(map(str, sys.version_info[:2])), "torch": _version("torch"),
                     "transformers": _version("transformers")},
        "data": data_hash() if reads_data else None,
    }
    return {"fingerprint": digest(fields), **fields}


def _resolved_dtype(values: Mapping[str, Any]) -> str:
    """The dtype a notebook's run computes in (``"auto"`` resolved for its ``device`` on this machine by
    :func:`sur_lab.models.resolve_dtype`, so the manifest names what ran, e.g. ``"float32"``)."""
    dtype = values.get("dtype", "float32")
    try:
        resolved, _ = resolve_dtype(dtype, values.get("device", "cpu"))
    except ValueError:
        return str(dtype)  # the notebook's own validation names the argument when it runs
    return str(resolved).removeprefix("torch.")


def compare_inputs(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Why a stored result's inputs differ from the current ones, one line per difference (empty: the same).

    The files are named: ``changed: sur_lab/studies/niah/report.py``, ``now imports: ...``, ``no longer imports: ...``.
    Under another Python minor version the file hashes are not comparable, and the version alone is reported.
    """
    reasons = []
    old_v, new_v = stored.get("versions", {}), current.get("versions", {})
    for key in ("python", "torch", "transformers"):
        if old_v.get(key) != new_v.get(key):
            reasons.append(f"{key} {old_v.get(key)} -> {new_v.get(key)}")
    if old_v.get("python") == new_v.get("python"):
        old_f, new_f = stored.get("files", {}), current.get("files", {})
        changed = [f for f in new_f if f in old_f and old_f[f] != new_f[f]]
        for label, names in (("changed", changed), ("now imports", [f for f in new_f if f not in old_f]),
                             ("no longer imports", [f for f in old_f if f not in new_f])):
            if names:
                reasons.append(f"{label}: {', '.join(names)}")
    for key in ("parameters", "model", "dtype", "data"):
        if stored.get(key) != current.get(key):
            reasons.append(f"{key}: {_short(stored.get(key))} -> {_short(current.get(key))}")
    if not reasons and stored.get("fingerprint") != current.get("fingerprint"):
        reasons.append("fingerprint differs")
    return reasons


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------------------------
# The manifest and the outputs it lists


def read_manifest(results: Path = RESULTS_DIR) -> dict[str, Any]:
    """``results/manifest.json`` (an empty manifest when the file does not exist).

    Raises:
        ValueError: naming the file when it is not a JSON object with a ``notebooks`` object.
    """
    path = Path(results) / MANIFEST
    if not path.is_file():
        return {"schema": SCHEMA, "notebooks": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("notebooks"), dict):
        raise ValueError(f"{path}: not a release manifest (a JSON object with a 'notebooks' object)")
    return data


def write_manifest(results: Path, manifest: Mapping[str, Any]) -> Path:
    """Write ``results/manifest.json`` atomically (notebooks in name order)."""
    path = Path(results) / MANIFEST
    data = {"schema": SCHEMA, "preset": manifest.get("preset", "default"), **manifest}
    data.update(schema=SCHEMA, notebooks=dict(sorted(manifest["notebooks"].items())))
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n", encoding="utf-8")
    return path


def _prefix(stem: str) -> str:
    """``"02_"`` for ``"02_allocation_geometry"``: the prefix every output file of the notebook carries."""
    return stem.split("_", 1)[0] + "_"


def _durable(path: Path, folder: Path) -> bool:
    """Whether a file under a sweep folder is committed: not a part file, a lock or a temporary file."""
    rel = path.relative_to(folder).parts
    return "parts" not in rel[:-1] and not any(p.startswith(".") for p in rel) and not path.name.endswith(".tmp")


def notebook_outputs(results: Path, stem: str) -> list[Path]:
    """The committed files of one notebook in ``results``: its executed copy, its figures and tables, and the
    durable files of its sweep folders (not a part file, lock or temporary file), sorted."""
    results = Path(results)
    out = [results / f"{stem}.ipynb"] if (results / f"{stem}.ipynb").is_file() else []
    prefix = _prefix(stem)
    for sub in ("figures", "tables"):
        folder = results / sub
        if folder.is_dir():
            out += sorted(p for p in folder.glob(prefix + "*") if p.is_file() and not p.name.startswith("."))
    sweeps = results / "sweeps"
    if sweeps.is_dir():
        for folder in sorted(p for p in sweeps.glob(prefix + "*") if p.is_dir()):
            out += sorted(p for p in folder.rglob("*") if p.is_file() and _durable(p, folder))
    return out


def file_facts(path: Path) -> dict[str, Any]:
    """``{"bytes", "sha256"}`` of a file."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return {"bytes": Path(path).stat().st_size, "sha256": h.hexdigest()}


def _parse_problem(path: Path) -> str | None:
    """Why a results file does not parse as what its suffix says (None when it does)."""
    try:
        if path.suffix in (".json", ".ipynb"):
            data = json.loads(path.read_text(encoding="utf-8"))
            if path.suffix == ".ipynb":
                nbformat.validate(nbformat.from_dict(data))
        elif path.suffix == ".csv":
            pd.read_csv(path)
        elif path.suffix == ".parquet":
            pq.read_metadata(path)
        elif path.suffix == ".png":
            if path.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
                return "not a PNG file"
        elif path.suffix == ".svg":
            if not ET.parse(path).getroot().tag.endswith("svg"):
                return "not an SVG document"
    except Exception as err:  # noqa: BLE001 - any parser's error is the answer
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")
    return None


def verify(results: Path = RESULTS_DIR, *, parse: bool = True) -> list[str]:
    """Check that ``results`` parses and matches its manifest: every output the manifest lists exists with its size
    and sha256, every notebook's outputs on disk are listed, and (``parse``) each JSON, notebook, CSV, Parquet, PNG and
    SVG file parses. Files that are not committed (part files, locks, failed copies) are not checked.

    Returns:
        One line per problem (empty: the folder is sound). A folder without a manifest and without outputs is sound
        (nothing has been released yet).
    """
    results = Path(results)
    problems: list[str] = []
    try:
        manifest = read_manifest(results)
    except ValueError as err:
        return [str(err)]
    if manifest.get("schema") != SCHEMA:
        problems.append(f"{results / MANIFEST}: schema {manifest.get('schema')!r}, this version reads {SCHEMA}")
    entries = manifest["notebooks"]
    stems = set(entries) | {p.stem for p in results.glob("*.ipynb") if not p.name.endswith(".failed.ipynb")}
    for stem in sorted(stems):
        entry = entries.get(stem)
        on_disk = {_relative(p, results): p for p in notebook_outputs(results, stem)}
        listed = dict(entry.get("outputs", {})) if isinstance(entry, dict) else {}
        if entry is None:
            problems.append(f"{stem}: files in results/ but no manifest entry ({', '.join(sorted(on_disk))})")
            continue
        if entry.get("status") not in STATUSES:
            problems.append(f"{stem}: status {entry.get('status')!r} is not one of {', '.join(STATUSES)}")
        if entry.get("status") == "finished" and f"{stem}.ipynb" not in listed:
            problems.append(f"{stem}: finished, but the manifest lists no executed copy {stem}.ipynb")
        for rel, facts in listed.items():
            path = results / rel
            if rel not in on_disk:
                problems.append(f"{stem}: {rel} is listed in the manifest but missing")
                continue
            actual = file_facts(path)
            if actual != {k: facts.get(k) for k in actual}:
                problems.append(f"{stem}: {rel} differs from the manifest (size or sha256)")
        for rel in sorted(set(on_disk) - set(listed)):
            problems.append(f"{stem}: {rel} is not listed in the manifest")
        if parse:
            problems += [f"{stem}: {rel} does not parse: {why}" for rel, p in on_disk.items()
                         if (why := _parse_problem(p)) is not None]
    return problems


# ---------------------------------------------------------------------------------------------------------------------
# Check: what is stale against the current code


@dataclass(frozen=True)
class NotebookCheck:
    """One notebook's release status against the current code.

    Attributes:
        notebook: its stem (``"02_allocation_geometry"``).
        status: ``"fresh"`` (finished, same fingerprint), ``"stale"`` (finished with other inputs), ``"failed"``
            (its last run did not finish), ``"missing"`` (never run, or its executed copy is gone) or ``"orphan"``
            (a manifest entry whose notebook no longer exists).
        reasons: why it is not fresh (:func:`compare_inputs`'s lines, the error of a failed run).
        entry: its manifest entry (empty when none).
        inputs: its current :func:`notebook_inputs` (empty for an orphan).
    """

    notebook: str
    status: str
    reasons: tuple[str, ...] = ()
    entry: Mapping[str, Any] = field(default_factory=dict)
    inputs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def wall_minutes(self) -> float | None:
        """The last run's wall time, minutes (None when never run)."""
        return (self.entry.get("run") or {}).get("wall_minutes")


def check_notebook(path: Path, entry: Mapping[str, Any] | None, results: Path,
                   parameters: Mapping[str, Any] | None = None) -> NotebookCheck:
    """:class:`NotebookCheck` of one notebook against its manifest ``entry`` (None: not in the manifest), for the
    release's ``parameters`` (default: the ``default`` preset's)."""
    path = Path(path)
    inputs = notebook_inputs(path, parameters)
    entry = dict(entry or {})
    status = entry.get("status", "missing")
    if not entry or status == "missing":
        return NotebookCheck(path.stem, "missing", ("never run",), entry, inputs)
    if status == "failed":
        return NotebookCheck(path.stem, "failed", (entry.get("error") or "no error recorded",), entry, inputs)
    if not (Path(results) / f"{path.stem}.ipynb").is_file():
        return NotebookCheck(path.stem, "missing", (f"{path.stem}.ipynb is gone",), entry, inputs)
    reasons = compare_inputs({**entry.get("inputs", {}), "fingerprint": entry.get("fingerprint")}, inputs)
    return NotebookCheck(path.stem, "stale" if reasons else "fresh", tuple(reasons), entry, inputs)


def manifest_preset(manifest: Mapping[str, Any], preset: str | None = None) -> str:
    """The preset of a results folder: its manifest's (``default`` for a new one), checked against ``preset`` when
    given.

    Raises:
        ValueError: naming ``--preset`` when it is not one of :data:`PRESETS` or differs from the folder's.
    """
    stored = manifest.get("preset", "default" if not manifest.get("notebooks") else None) or "default"
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"--preset {preset!r}: choose from {', '.join(PRESETS)}")
    if preset is not None and manifest.get("notebooks") and preset != stored:
        raise ValueError(f"--preset {preset!r}: this results folder holds a {stored!r} release; give another "
                         "--results folder")
    return preset or stored


def check(results: Path = RESULTS_DIR, paths: Sequence[Path] | None = None) -> list[NotebookCheck]:
    """Every notebook's :class:`NotebookCheck` (default: all of ``notebooks/``) at the folder's preset, then the
    manifest's orphans when all notebooks are checked. Runs nothing and loads no model.

    Raises:
        ValueError: when the manifest does not parse (:func:`read_manifest`).
    """
    manifest = read_manifest(results)
    entries, parameters = manifest["notebooks"], PRESETS[manifest_preset(manifest)]
    selected = list(paths) if paths is not None else notebooks("*")
    out = [check_notebook(p, entries.get(p.stem), results, parameters(p)) for p in selected]
    if paths is None:
        known = {p.stem for p in selected}
        out += [NotebookCheck(stem, "orphan", ("its notebook no longer exists in notebooks/",), entries[stem])
                for stem in sorted(set(entries) - known)]
    return out


def format_minutes(minutes: float | None) -> str:
    """``"–"``, ``"45 s"``, ``"12 min"``, ``"2 h 05 min"``."""
    if minutes is None:
        return "–"
    if minutes < 1:
        return f"{minutes * 60:.0f} s"
    if minutes < 60:
        return f"{minutes:.0f} min"
    hours, rest = divmod(round(minutes), 60)
    return f"{hours} h {rest:02d} min"


def check_report(checks: Sequence[NotebookCheck]) -> str:
    """The ``--check`` text: one line per notebook (status, last wall time, why), then a summary with the estimated
    time of the notebooks a release would run (their last wall times)."""
    width = max((len(c.notebook) for c in checks), default=8)
    lines = []
    for c in checks:
        why = "; ".join(c.reasons)
        lines.append(f"{c.notebook.ljust(width)}  {c.status:<7}  {format_minutes(c.wall_minutes):>9}  {why}".rstrip())
    counts = {s: sum(c.status == s for c in checks) for s in ("fresh", "stale", "failed", "missing", "orphan")}
    todo = [c for c in checks if c.status in ("stale", "failed", "missing")]
    known = [c.wall_minutes for c in todo if c.wall_minutes is not None]
    estimate = ""
    if todo:
        estimate = (f"; `sur-lab release` would run {len(todo)}"
                    + (f", about {format_minutes(sum(known))} by their last wall times" if known else "")
                    + (f" ({len(todo) - len(known)} never timed)" if len(known) < len(todo) else ""))
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n or s in ("fresh", "stale"))
    return "\n".join(lines + [f"{summary}{estimate}"]) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# Running: machine facts, peak memory and progress, executed copies without duplicated figures


def git_commit(root: Path = REPO_ROOT) -> dict[str, Any]:
    """``{"commit": hex or "unknown", "dirty": bool}``: ``dirty`` when ``sur_lab/`` or ``notebooks/`` differ from
    the commit (the fingerprint, not the commit, decides freshness)."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "sur_lab", "notebooks"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}
    return {"commit": head, "dirty": bool(status.strip())}


def cpu_facts() -> dict[str, Any]:
    """The CPU model, the flags of :data:`CPU_FLAGS` it has, its logical CPU count and torch's CPU capability."""
    model, flags = "", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model") and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    if not model:
        model = platform.processor() or platform.machine()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        capability = None
    return {"cpu_model": model, "cpu_flags": [f for f in CPU_FLAGS if f in flags], "cpus": os.cpu_count(),
            "torch_cpu_capability": capability}


def _rss_of_children() -> int | None:
    """Summed resident memory of this process's descendants (the kernel, its Ray workers), bytes; None without
    psutil."""
    try:
        # optional dependency: psutil is not a requirement of sur_lab
        import psutil
    except ImportError:
        return None
    total = 0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += child.memory_info().rss
    return total


def sweep_progress(folder: Path) -> tuple[int, int | None]:
    """``(records written, records planned)`` of a sweep folder while it runs: complete lines of its part files,
    and ``records_planned`` of its ``sweep.json`` (None when unknown)."""
    folder = Path(folder)
    planned = None
    with contextlib.suppress(OSError, ValueError):
        planned = json.loads((folder / "sweep.json").read_text(encoding="utf-8")).get("records_planned")
    done = 0
    for part in (folder / "parts").glob("*.jsonl"):
        with contextlib.suppress(OSError):
            data = part.read_bytes()
            done += data.count(b"\n")
    return done, planned


class RunWatch:
    """Watches one notebook's run from outside the kernel, every ``interval`` seconds: the peak summed RSS of this
    process's descendants, and (``progress``) a tqdm bar of the notebook's elapsed minutes against its last wall
    time (the ETA) plus one bar per sweep it writes (records against ``records_planned``)."""

    def __init__(self, results: Path, stem: str, *, expected_minutes: float | None, progress: bool,
                 label: str = "", interval: float = 2.0) -> None:
        self.results, self.stem, self.expected = Path(results), stem, expected_minutes
        self.progress, self.label, self.interval = progress, label or stem, interval
        self.started = time.time()
        self.peak_rss: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"release-watch-{stem}", daemon=True)
        self._bars: dict[str, Any] = {}

    def __enter__(self) -> RunWatch:
        if self.progress:
            # one unit per minute of wall time: tqdm's rate is then 1, and its remaining time the last run's remainder
            fmt = ("{desc}: {percentage:3.0f}%|{bar}| {elapsed} of about {total:.0f} min, ETA {remaining}"
                   if self.expected else "{desc}: {elapsed} (no earlier run to estimate from)")
            self._bars["notebook"] = tqdm(total=max(self.expected, 1 / 60) if self.expected else None,
                                          desc=self.label, bar_format=fmt, leave=True, mininterval=1)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        for bar in self._bars.values():
            bar.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        """Take one memory sample and refresh the bars."""
        rss = _rss_of_children()
        if rss is not None:
            self.peak_rss = max(self.peak_rss or 0, rss)
        if not self.progress:
            return
        bar = self._bars["notebook"]
        elapsed = (time.time() - self.started) / 60
        bar.n = min(elapsed, bar.total) if bar.total else elapsed
        bar.refresh()
        sweeps = self.results / "sweeps"
        for folder in sorted(sweeps.glob(_prefix(self.stem) + "*")) if sweeps.is_dir() else []:
            manifest = folder / "sweep.json"
            if not manifest.is_file() or manifest.stat().st_mtime < self.started - 1:
                continue
            done, planned = sweep_progress(folder)
            if folder.name not in self._bars:
                self._bars[folder.name] = tqdm(total=planned, initial=done, desc=f"  {folder.name[:40]}",
                                               unit="record", leave=False)
            sweep_bar = self._bars[folder.name]
            sweep_bar.update(done - sweep_bar.n)

    @property
    def peak_rss_mib(self) -> float | None:
        """The peak, MiB (None when psutil is missing and the fallback is used instead)."""
        return None if self.peak_rss is None else round(self.peak_rss / 2**20, 1)


def _children_maxrss_mib() -> float:
    """The largest resident set of any waited-for child process so far, MiB (``getrusage``; Linux reports KiB)."""
    # POSIX only: `resource` does not exist on Windows
    import resource

    scale = 1 if sys.platform == "darwin" else 1024
    return round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale / 2**20, 1)


def _figure_names(source: str) -> list[str]:
    """The figure names a cell passes to ``save_figure`` (an f-string's fields become wildcards)."""
    out = []
    for m in re.finditer(r"save_figure\(\s*[^,()]+,\s*(f?)([\"'])(.+?)\2", source):
        literal = m.group(3)
        out.append(re.sub(r"\\\{.*?\\\}", ".+?", re.escape(literal)) if m.group(1) else re.escape(literal))
    return out


def link_figures(executed: Path, results: Path, written: Sequence[Path]) -> int:
    """Replace the image outputs of every cell that saved its figure with one markdown output linking the saved
    PNG files (``figures/<name>.png``), so the executed copy does not hold each figure twice. Cells whose saved file
    is not found keep their images. The replacement carries ``metadata.sur_lab.figures`` (the linked paths).

    Args:
        executed: the executed copy (rewritten atomically).
        results: the results folder the figure paths are relative to.
        written: the figure files this run wrote.

    Returns:
        How many image outputs were replaced.
    """
    pngs = sorted(Path(p) for p in written if Path(p).suffix == ".png")
    nb = json.loads(Path(executed).read_text(encoding="utf-8"))
    every = [n for cell in nb.get("cells", []) for n in _figure_names("".join(cell.get("source", "")))]
    # a file belongs to the longest name it matches ("01_bound_rows_x" to "01_bound_rows", not to "01_bound")
    owner = {p: max((n for n in every if re.fullmatch(f"{n}(_.*)?", p.stem)), key=len, default=None) for p in pngs}
    replaced = 0
    for cell in nb.get("cells", []):
        outputs = cell.get("outputs", [])
        images = [i for i, o in enumerate(outputs) if any(k.startswith("image/") for k in o.get("data", {}))]
        names = _figure_names("".join(cell.get("source", ""))) if images else []
        linked = [p for p in pngs if owner[p] in names]
        if not linked:
            continue
        rels = [_relative(p, results) for p in linked]
        text = "\n\n".join(f"![{Path(r).stem}]({r})" for r in rels)
        link = {"output_type": "display_data", "data": {"text/markdown": text, "text/plain": text},
                "metadata": {"sur_lab": {"figures": rels}}}
        cell["outputs"] = [link if i == images[0] else o for i, o in enumerate(outputs) if i not in images[1:]]
        replaced += len(images)
    if replaced:
        with atomic_path(executed) as tmp:
            tmp.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return replaced


@contextlib.contextmanager
def _release_environment(results: Path) -> Iterator[None]:
    """The environment the kernels inherit: outputs under ``results`` (absolute, since kernels run from
    ``notebooks/``), PNG (at :data:`FIGURE_DPI`) + SVG figures, CSV + Parquet tables."""
    values = {"SUR_LAB_OUTPUTS_DIR": str(Path(results).resolve()), FIGURE_FORMATS_ENV: FIGURE_FORMATS,
              FIGURE_DPI_ENV: str(FIGURE_DPI), TABLE_FORMATS_ENV: TABLE_FORMATS}
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def release_lock(results: Path) -> Iterator[None]:
    """Hold ``results/.release.lock`` for the block: two releases writing one manifest would lose entries.

    Raises:
        ReleaseBusyError: naming the folder when another process holds it.
    """
    Path(results).mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(Path(results) / ".release.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ReleaseBusyError(f"another sur-lab release is writing {results} (lock {lock.lock_file}); wait for it "
                               "to finish") from None
    try:
        yield
    finally:
        lock.release()


def _now() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")


def _weights_ids(results: Path, stem: str) -> list[str]:
    """The weights hashes (8 hex) in the names of the notebook's sweep folders (``..._w-<hash>``,
    :func:`sur_lab.sweeps.store.sweep_folder`)."""
    sweeps = Path(results) / "sweeps"
    names = [p.name for p in sweeps.glob(_prefix(stem) + "*")] if sweeps.is_dir() else []
    return sorted({m.group(1) for n in names if (m := re.search(r"_w-?([0-9a-f]{8})$", n))})


Runner = Callable[..., Path]


def run_one(path: Path, results: Path, manifest: dict[str, Any], *, runner: Runner = run_notebook,
            progress: bool = True, label: str = "", preset: str = "default") -> dict[str, Any]:
    """Run one notebook at the release's parameters into ``results`` and return its manifest entry (also stored in
    ``manifest``); a failure is recorded, not raised (except an interruption, after it is recorded).

    Args:
        path: the notebook.
        results: the results folder.
        manifest: the manifest being built (its entry for the notebook is replaced).
        runner: ``runner(path, parameters, outputs=..., progress=...) -> executed copy``
            (:func:`sur_lab.runtime.run_notebooks.run_notebook`; tests pass a fake).
        progress: show tqdm bars (:class:`RunWatch`).
        label: the notebook bar's description.
        preset: a key of :data:`PRESETS`: which parameters the notebook runs with.

    Raises:
        KeyboardInterrupt: on Ctrl-C or SIGTERM, after the entry (status ``failed``) is stored.
    """
    results = Path(results)
    params = PRESETS[preset](path)
    inputs = notebook_inputs(path, params)
    previous = manifest["notebooks"].get(path.stem, {})
    expected = (previous.get("run") or {}).get("wall_minutes")
    values = effective_parameters(path, params)
    started, t0 = _now(), time.perf_counter()
    start_epoch = time.time()
    error, interrupted = None, False
    with _release_environment(results), RunWatch(results, path.stem, expected_minutes=expected, progress=progress,
                                                 label=label) as watch:
        try:
            runner(path, params, outputs=results, progress=False)
        except NotebookBusyError:
            raise
        except KeyboardInterrupt as err:
            error, interrupted = f"interrupted: {err or 'Ctrl-C'}", True
        except Exception as err:  # noqa: BLE001 - recorded in the manifest; the release goes on
            error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    wall = (time.perf_counter() - t0) / 60
    if error is None and not (results / f"{path.stem}.ipynb").is_file():
        error = f"the runner wrote no executed copy {path.stem}.ipynb"
    written = [p for p in notebook_outputs(results, path.stem) if p.stat().st_mtime >= start_epoch - 1]
    if error is None:
        for sub in ("figures", "tables"):  # files of an earlier run with other parameters (every run rewrites its own)
            for old in (results / sub).glob(_prefix(path.stem) + "*") if (results / sub).is_dir() else []:
                if old.is_file() and old.stat().st_mtime < start_epoch - 1:
                    old.unlink()
        link_figures(results / f"{path.stem}.ipynb", results, [p for p in written if p.parent.name == "figures"])
    machine = machine_stamp()
    threads = values.get("num_threads")
    entry = {
        "notebook": _relative(path, REPO_ROOT),
        "status": "finished" if error is None else "failed",
        "preset": preset,
        "parameters": params,
        "fingerprint": inputs["fingerprint"],
        "inputs": {k: v for k, v in inputs.items() if k != "fingerprint"},
        "run": {
            **git_commit(),
            "started": started,
            "finished": _now(),
            "wall_minutes": round(wall, 2),
            "peak_rss_mib": watch.peak_rss_mib if watch.peak_rss_mib is not None else _children_maxrss_mib(),
            "peak_rss_source": ("psutil: summed RSS of the kernel and its child processes, sampled every "
                                f"{watch.interval:g} s") if watch.peak_rss_mib is not None else
                               "getrusage: largest child process so far",
            "threads": {"num_threads": threads, "meaning": "torch threads the notebook set (0: torch's default, "
                        "one per core)" if threads is not None else "not a notebook parameter",
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
            "machine": {**cpu_facts(), "platform": machine["platform"], "load_1min": machine["load_1min"]},
            "weights": _weights_ids(results, path.stem),
        },
        "error": error,
        "outputs": {_relative(p, results): file_facts(p) for p in notebook_outputs(results, path.stem)},
    }
    manifest["notebooks"][path.stem] = entry
    write_manifest(results, manifest)
    if interrupted:
        raise KeyboardInterrupt(error)
    return entry


def release(paths: Sequence[Path] | None = None, results: Path = RESULTS_DIR, *, preset: str | None = None,
            force: bool = False, runner: Runner = run_notebook, progress: bool = True, out=sys.stdout) -> int:
    """Run every selected notebook that is not fresh (:func:`check`) into ``results``, then rewrite the index and the
    claims table. Each finished or failed notebook's manifest entry is written at once, so an interrupted release
    keeps what finished and the next call continues.

    Args:
        paths: the notebooks (default: all of ``notebooks/``).
        results: the results folder.
        preset: a key of :data:`PRESETS` (default: the folder's, ``default`` for a new one); ``smoke`` is refused
            for the committed ``results/``.
        force: run the selected notebooks even when fresh.
        runner: see :func:`run_one`.
        progress: tqdm bars per notebook and per sweep.
        out: where the per-notebook lines go.

    Returns:
        0 when every notebook run finished, 1 when one failed, 130 when interrupted.

    Raises:
        ReleaseBusyError: when another release holds the folder's lock.
        ValueError: naming ``--preset`` when it is unknown, differs from the folder's, or is ``smoke`` for the
            committed ``results/`` (before anything runs).
    """
    results = Path(results)
    if preset not in (None, "default") and results.resolve() == RESULTS_DIR.resolve():
        raise ValueError(f"--preset {preset!r}: {RESULTS_DIR} holds the default release; give --results FOLDER")
    selected = list(paths) if paths is not None else notebooks("*")
    with release_lock(results):
        manifest = read_manifest(results)
        preset = manifest_preset(manifest, preset)
        manifest["preset"] = preset
        checks = [check_notebook(p, manifest["notebooks"].get(p.stem), results, PRESETS[preset](p))
                  for p in selected]
        todo = [(p, c) for p, c in zip(selected, checks) if force or c.status != "fresh"]
        for c in checks:
            if c.status == "fresh" and not force:
                print(f"   {c.notebook}: fresh (finished {c.entry.get('run', {}).get('finished', '?')}), not run",
                      file=out, flush=True)
        failures = 0
        for i, (path, c) in enumerate(todo, start=1):
            why = "forced" if c.status == "fresh" else f"{c.status}: {'; '.join(c.reasons)}"
            print(f"== [{i}/{len(todo)}] {path.stem} ({why}); last wall time {format_minutes(c.wall_minutes)}",
                  file=out, flush=True)
            try:
                entry = run_one(path, results, manifest, runner=runner, progress=progress,
                                label=f"[{i}/{len(todo)}] {path.stem}", preset=preset)
            except KeyboardInterrupt as err:
                write_index(results, manifest)
                print(f"   INTERRUPTED ({err}); finished notebooks are kept, and `sur-lab release` resumes (the "
                      f"sweeps from their part files)", file=out, flush=True)
                return 130
            except Exception as err:  # noqa: BLE001 - e.g. NotebookBusyError: another run of this notebook
                failures += 1
                print(f"   NOT RUN: {type(err).__name__}: {err}", file=out, flush=True)
                continue
            run = entry["run"]
            if entry["status"] == "finished":
                print(f"   finished in {format_minutes(run['wall_minutes'])}, peak memory {run['peak_rss_mib']} MiB",
                      file=out, flush=True)
            else:
                failures += 1
                print(f"   FAILED after {format_minutes(run['wall_minutes'])}: {entry['error']} (partial copy "
                      f"{failed_path(results / (path.stem + '.ipynb')).name})", file=out, flush=True)
        write_index(results, manifest)
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------------------------------
# The generated index


def _link(rel: str) -> str:
    return f"[{Path(rel).name}]({rel})"


def sizes_markdown(table: pd.DataFrame, *, smoke_preset: str = "smoke") -> list[str]:
    """The lines of a :func:`sur_lab.runtime.sizes.sizes_table` as a Markdown table (its ``smoke_*`` columns, when
    present, headed by ``smoke_preset``): notebook, preset, cases, wall time (:func:`format_minutes`), the primary
    comparison (family and words), its MDE (:func:`sur_lab.analysis.decisions.effect_text`) and its verdict."""
    def cases(v: Any) -> str:
        return "–" if pd.isna(v) else str(int(v))

    def minutes(v: float) -> str:
        return format_minutes(None if math.isnan(v) else float(v))

    smoke = "smoke_cases" in table.columns
    head = ["notebook", "preset", "cases", "wall time", "primary comparison", "MDE (80 % power)", "MDE at `paper`",
            "verdict"]
    head += [f"{smoke_preset} cases", f"{smoke_preset} wall time", f"{smoke_preset} MDE"] if smoke else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table.itertuples(index=False):
        cells = [f"`{r.notebook}`", r.preset, cases(r.cases), minutes(r.wall_minutes), f"{r.family}: {r.comparison}",
                 effect_text(r.mde, r.mde_unit), effect_text(r.paper_mde, r.mde_unit), r.verdict]
        if smoke:
            cells += [cases(r.smoke_cases), minutes(r.smoke_minutes), effect_text(r.smoke_mde, r.mde_unit)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def machine_description(machine: Mapping[str, Any]) -> str:
    """One run's machine stamp (``run["machine"]`` of a manifest entry) in words: CPU model, CPU count, the recorded
    CPU flags and torch's CPU capability."""
    flags = ", ".join(machine.get("cpu_flags", [])) or "none recorded"
    return (f"{machine.get('cpu_model') or '?'} ({machine.get('cpus')} CPUs; flags {flags}; torch CPU capability "
            f"{machine.get('torch_cpu_capability')})")


def machine_labels(entries: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, str], dict[str, str]]:
    """Which machine ran each notebook, for a release whose runs may come from several machines (a resumed release,
    a notebook re-run in a later session on another CPU).

    Args:
        entries: the manifest's ``notebooks`` (stem -> entry with ``run["machine"]``).

    Returns:
        ``(by_notebook, machines)``: stem -> label for every entry whose run carries a machine stamp, and label ->
        :func:`machine_description`. Labels are ``M1``, ``M2``, ... in order of first appearance by notebook name;
        there is one label per distinct description. Wall times of runs with different labels were measured on
        different CPUs: a sum over them is not one machine's time.
    """
    by_notebook: dict[str, str] = {}
    machines: dict[str, str] = {}
    for stem in sorted(entries):
        stamp = (entries[stem].get("run") or {}).get("machine")
        if not stamp:
            continue
        text = machine_description(stamp)
        label = next((k for k, v in machines.items() if v == text), None)
        if label is None:
            label = f"M{len(machines) + 1}"
            machines[label] = text
        by_notebook[stem] = label
    return by_notebook, machines


def wall_time_line(entries: Mapping[str, Mapping[str, Any]], stems: Sequence[str]) -> str:
    """The release's total wall time over its finished notebooks, with a subtotal per machine when the runs came
    from more than one (:func:`machine_labels`)."""
    done = [s for s in stems if entries.get(s, {}).get("status") == "finished"]
    if not done:
        return "No notebook has finished in this release yet."
    minutes = {s: (entries[s].get("run") or {}).get("wall_minutes") or 0 for s in done}
    line = f"Total wall time of the {len(done)} finished notebooks: {format_minutes(sum(minutes.values()))}."
    labels, machines = machine_labels({s: entries[s] for s in done})
    if len(machines) > 1:
        parts = [f"{label} {format_minutes(sum(m for s, m in minutes.items() if labels.get(s) == label))}"
                 for label in machines]
        if any(s not in labels for s in done):
            parts.append(f"unrecorded {format_minutes(sum(m for s, m in minutes.items() if s not in labels))}")
        line += (f" The runs came from {len(machines)} machines ({', '.join(parts)}): the sum is not one machine's "
                 "time.")
    return line


def index_markdown(results: Path, manifest: Mapping[str, Any]) -> str:
    """``results/README.md``: what the folder is, the runs table (status, wall time, peak memory, commit), the
    machine, what each study cost and can decide (:func:`sizes_markdown`), then each notebook's files."""
    entries = manifest["notebooks"]
    preset = manifest.get("preset", "default")
    stems = sorted(set(entries) | {p.stem for p in notebooks("*")})
    lines = ["# Results", "",
             f"Every notebook run at its `{preset}` preset, written by `sur-lab release` (`make release`) and indexed "
             "here from `manifest.json`; nothing in this folder is typed by hand. Start with the claims table, "
             "[claims.md](claims.md): the paper's claims against this release's estimates. `sur-lab release --check` "
             "lists what is stale against the current code.", ""]
    if preset == "smoke":
        lines += ["**A smoke release: plumbing sizes on the small model; it decides nothing.**", ""]
    labels, machines = machine_labels(entries)
    several = len(machines) > 1
    lines += ["## Runs", "", "| notebook | status | wall time | peak memory | finished | commit |"
              + (" machine |" if several else ""), "|---|---|---|---|---|---|" + ("---|" if several else "")]
    for stem in stems:
        entry = entries.get(stem, {})
        run = entry.get("run") or {}
        status = entry.get("status", "missing")
        peak = f"{run['peak_rss_mib']:.0f} MiB" if run.get("peak_rss_mib") is not None else "–"
        commit = (run.get("commit") or "–")[:10] + (" (dirty)" if run.get("dirty") else "")
        name = f"[`{stem}`]({stem}.ipynb)" if f"{stem}.ipynb" in entry.get("outputs", {}) else f"`{stem}`"
        lines.append(f"| {name} | {status} | {format_minutes(run.get('wall_minutes'))} | {peak} | "
                     f"{(run.get('finished') or '–')[:16].replace('T', ' ')} | {commit} |"
                     + (f" {labels.get(stem, '–')} |" if several else ""))
    lines += ["", wall_time_line(entries, stems), ""]
    lines += ([f"- Machine {label}: {text}." for label, text in machines.items()] if several else
              [f"Machine: {text}." for text in machines.values()]) or ["Machine: no notebook has run yet."]
    lines += ["", "## What each study cost, and what it can decide", "",
              "One row per notebook with a sweepable study (`sur_lab.runtime.sizes`): its cases (distinct case ids in "
              "its sweep records), its wall time, its primary comparison's minimal detectable effect at 80 % power, "
              "two-sided 5 %, at this run's parameters (\"none\": this size cannot reach 80 %), the same at the "
              "`paper` preset's sizes (the size that decides a primary the default cannot: a size the suite cannot "
              "hold within its 3 hours belongs to that preset), and the verdict of the notebook's saved decided "
              "table. `sur-lab release --sizes SMOKE_DIR` prints it beside a smoke "
              "release's.", "", *sizes_markdown(sizes_table(results, manifest))]
    for stem in stems:
        entry = entries.get(stem)
        if not entry or not entry.get("outputs"):
            continue
        outs = list(entry["outputs"])
        lines += ["", f"## {stem}", "", f"Parameters: `{json.dumps(entry.get('parameters') or {})}` (besides the "
                  f"notebook's defaults); fingerprint `{entry.get('fingerprint', '')[:12]}` over "
                  f"{len(entry.get('inputs', {}).get('files', {}))} files.", ""]
        for label, pick in (("Executed notebook", lambda r: r.endswith(".ipynb")),
                            ("Figures", lambda r: r.startswith("figures/") and r.endswith(".png")),
                            ("Tables", lambda r: r.startswith("tables/") and r.endswith(".csv")),
                            ("Sweeps", lambda r: r.startswith("sweeps/"))):
            chosen = [r for r in outs if pick(r)]
            if chosen:
                lines.append(f"- {label}: " + ", ".join(_link(r) for r in chosen))
        svg = sum(r.endswith(".svg") for r in outs)
        parquet = sum(r.startswith("tables/") and r.endswith(".parquet") for r in outs)
        if svg or parquet:
            lines.append(f"- Beside them: each figure as SVG ({svg} in all), each table as Parquet ({parquet} in all).")
    return "\n".join(lines) + "\n"


def write_index(results: Path, manifest: dict[str, Any] | None = None) -> list[Path]:
    """Write the manifest with a ``missing`` entry for every notebook never run (its parameters at the folder's
    preset), ``results/README.md`` (:func:`index_markdown`) and the claims table (``claims.md``, ``claims.csv``;
    :func:`sur_lab.runtime.claims.write_claims`), each atomically; returns their paths."""
    results = Path(results)
    results.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(results) if manifest is None else manifest
    preset = manifest_preset(manifest)
    manifest["preset"] = preset
    for path in notebooks("*"):
        manifest["notebooks"].setdefault(path.stem, {
            "notebook": _relative(path, REPO_ROOT), "status": "missing", "preset": preset,
            "parameters": PRESETS[preset](path), "outputs": {}})
    written = [write_manifest(results, manifest)]
    readme = results / "README.md"
    with atomic_path(readme) as tmp:
        tmp.write_text(index_markdown(results, manifest), encoding="utf-8")
    return [*written, readme, *write_claims(results)]


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def select(patterns: Sequence[str]) -> list[Path]:
    """Notebooks matching any of ``patterns`` (file-name prefixes or globs, as ``sur-lab run``), in name order.

    Raises:
        ValueError: naming the ``--only`` pattern that matches no notebook and listing the notebooks.
    """
    found: list[Path] = []
    for pattern in patterns:
        hits = notebooks(pattern)
        if not hits:
            names = ", ".join(p.stem for p in notebooks("*"))
            raise ValueError(f"--only {pattern!r} matches no notebook in {NOTEBOOK_DIR}; available: {names}")
        found += [p for p in hits if p not in found]
    return sorted(found)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sur-lab release", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run every notebook at its default preset into results/ (executed copies, figures, tables, "
                    "sweep records, manifest.json, README.md, the claims table), skipping notebooks whose inputs are "
                    "unchanged since they finished; an interrupted release resumes.")
    parser.add_argument("--only", nargs="+", metavar="NOTEBOOK", default=None,
                        help="only these notebooks: file-name prefixes or globs (02 09, 0[0-3]_*)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="list what is stale against the current code and why, and verify results/; runs nothing "
                           "(exit 1 only when results/ does not parse or match its manifest)")
    mode.add_argument("--verify", action="store_true",
                      help="only verify that results/ parses and matches its manifest (exit 1 when not)")
    mode.add_argument("--index", action="store_true",
                      help="rewrite results/README.md and the claims table from the manifest (and the manifest "
                           "itself, adding a 'missing' entry for a notebook never run); runs nothing")
    mode.add_argument("--sizes", nargs="?", const="", default=None, metavar="SMOKE_DIR",
                      help="print, as Markdown, what each study's run in --results cost and what it can decide "
                           "(cases, wall time, primary comparison's MDE and verdict), with SMOKE_DIR's cases, wall "
                           "time and MDE beside them when given (e.g. a --preset smoke release); runs nothing")
    parser.add_argument("--force", action="store_true", help="run the selected notebooks even when fresh")
    parser.add_argument("--preset", choices=list(PRESETS), default=None,
                        help="default (the committed results/) or smoke (a quick plumbing release into another "
                             "--results folder); default: the folder's own")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="the results folder (default: results/)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def sizes_report(results: Path, smoke: Path | None = None) -> str:
    """``--sizes``: :func:`sizes_markdown` of ``results`` (beside ``smoke``'s cases, wall time and MDE when given).

    Raises:
        ValueError: naming ``--results`` or ``--sizes`` when the folder has no ``manifest.json``, or as
            :func:`read_manifest`.
    """
    for flag, folder in (("--results", results), ("--sizes", smoke)):
        if folder is not None and not (Path(folder) / MANIFEST).is_file():
            raise ValueError(f"{flag} {str(folder)!r}: no {MANIFEST} there (not a release folder)")
    manifest = read_manifest(results)
    other = read_manifest(smoke) if smoke is not None else None
    table = sizes_table(results, manifest, smoke=smoke, smoke_manifest=other)
    label = manifest_preset(other) if other is not None else "smoke"
    return "\n".join(sizes_markdown(table, smoke_preset=label)) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``sur-lab release``'s entry point; returns the exit code (module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    prog = "sur-lab release"
    try:
        paths = select(args.only) if args.only else None
        results = Path(args.results)
        if results.exists() and not results.is_dir():
            raise ValueError(f"--results {str(results)!r} is a file, not a folder")
        if args.verify or args.check:
            if args.check:
                sys.stdout.write(check_report(check(results, paths)))
            problems = verify(results)
            for line in problems:
                print(f"{prog}: results/ does not match its manifest: {line}", file=sys.stderr)
            if not problems:
                print(f"{results}: parses and matches its manifest")
            return 1 if problems else 0
        if args.sizes is not None:
            sys.stdout.write(sizes_report(results, Path(args.sizes) if args.sizes else None))
            return 0
        if args.index:
            with release_lock(results):
                for path in write_index(results):
                    print(f"wrote {path}")
            return 0
        return release(paths, results, preset=args.preset, force=args.force, progress=not args.no_progress)
    except (ValueError, ReleaseBusyError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
