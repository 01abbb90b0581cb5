"""Run the notebook suite under papermill: every ``notebooks/*.ipynb`` in name order, executed copies to ``outputs/``.

Usage::

    python -m sur_lab.runtime.run_notebooks                 # default parameters (the README's first command)
    python -m sur_lab.runtime.run_notebooks --smoke         # each notebook's small smoke parameters (metadata)
    python -m sur_lab.runtime.run_notebooks --only 00_* -p max_new_tokens 16

Notebooks are found by glob, not a hand-kept list. Each notebook's smoke parameters live in its own metadata under
``sur_lab.smoke_parameters``. A default (non-smoke) suite run also applies each notebook's ``sur_lab.suite_parameters``
metadata: how the suite runs it on a dedicated machine, without changing what it computes (notebook 02, a quality
study whose records do not depend on concurrency, fans its sweep out over two Ray workers, and so do 08 and 09; their
own default stays one).
Parameters given with ``-p`` are passed only to notebooks that declare them and override both (``-p workers 1`` runs
02 in one process); a ``-p`` NAME that no selected notebook declares is an error before anything runs, and so is a
value of the wrong type or outside the range its parameters cell declares (``-p example_index -1``;
:func:`sur_lab.runtime.params.check_notebook_parameters`).

Nothing good is ever overwritten by a failure:

- A notebook executes into a temporary file beside its target (``.<name>.<pid>.running.ipynb``); only a run that
  finishes is renamed into place as ``outputs/<name>.ipynb`` (an atomic ``os.replace``).
- A failed or interrupted run (a cell error, Ctrl-C, SIGTERM) is kept as ``outputs/<name>.failed.ipynb`` with an
  error marker (first cell and ``metadata.sur_lab.run_error``); the last good ``outputs/<name>.ipynb`` is untouched.
  A run killed outright (SIGKILL) leaves its temporary file, which the next run of that notebook turns into
  ``<name>.failed.ipynb`` ("killed").
- One notebook runs once at a time per outputs folder: a second concurrent run fails at once with
  :class:`NotebookBusyError` (a ``filelock`` lock file ``.<name>.lock``) instead of racing the first.
- Figures and tables are written atomically by :mod:`sur_lab.analysis.plotting`.

Everything a run writes lands under one folder: the outputs folder (``--outputs``, else ``$SUR_LAB_OUTPUTS_DIR``, else
``outputs/``) is made absolute before the kernel starts and handed to it as ``$SUR_LAB_OUTPUTS_DIR``, so the executed
copies, sweeps, tables and figures all go there, although the kernel runs in ``notebooks/``. The runner also tells the
kernel its preset (``$SUR_LAB_PRESET``: ``smoke`` for ``--smoke``), so that each notebook's "This run" section can say
when it is a plumbing check (:func:`sur_lab.studies.presets.show_smoke_banner`). Progress bars are left in their final
state in the executed copy (a tqdm bar's last text), never frozen at 0 %.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import html
import json
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import nbformat
import papermill as pm
from filelock import FileLock, Timeout

from sur_lab.analysis.plotting import STATIC_OUTPUTS_ENV
from sur_lab.checks import pid_alive as _pid_alive
from sur_lab.paths import REPO_ROOT, display_path, outputs_dir
from sur_lab.runtime.params import ParameterError, check_notebook_parameters, literal_defaults, parameters_cell
from sur_lab.studies.presets import PRESET_ENV

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
_RUNNING = ".running.ipynb"

#: How many kernels :func:`run_notebook` starts before it gives up on a kernel that dies before it answers
#: (:func:`kernel_start_failed`).
KERNEL_START_ATTEMPTS = 3


def kernel_start_failed(err: BaseException) -> bool:
    """Whether ``err`` is a kernel that died before it replied to ``kernel_info``: jupyter_client picks the kernel's
    five TCP ports as free ones and the kernel binds them later, so two kernels started at once (parallel test workers,
    two notebooks run side by side) can pick the same port, and the loser dies with ``ZMQError: Address already in
    use`` before any cell runs. Such a run is safe to start again; a kernel that dies later (a cell crashed it) is
    not matched."""
    return isinstance(err, RuntimeError) and "before replying to kernel_info" in str(err)


class NotebookBusyError(RuntimeError):
    """Another process is running the same notebook into the same outputs folder."""


class RunInterrupted(KeyboardInterrupt):
    """SIGTERM received while a notebook was running (handled like Ctrl-C: the run is kept as ``.failed.ipynb``)."""


def notebooks(pattern: str = "*", folder: Path | None = None) -> list[Path]:
    """Notebooks under ``folder`` (default ``notebooks/``) whose file name matches ``pattern``, sorted by name."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a file-name glob string ('02', '03_*', '*'); got {type(pattern).__name__}")
    folder = Path(folder) if folder is not None else NOTEBOOK_DIR
    glob = pattern if "." in pattern else pattern + "*"
    return sorted(p for p in folder.glob("*.ipynb") if fnmatch.fnmatch(p.name, glob) and not p.name.startswith("."))


def _metadata_parameters(path: Path, key: str) -> dict:
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    return dict(nb.get("metadata", {}).get("sur_lab", {}).get(key, {}))


def smoke_parameters(path: Path) -> dict:
    """The ``sur_lab.smoke_parameters`` dict from a notebook's metadata (empty when absent)."""
    return _metadata_parameters(path, "smoke_parameters")


def suite_parameters(path: Path) -> dict:
    """The ``sur_lab.suite_parameters`` dict from a notebook's metadata (empty when absent): what a default suite run
    (``make notebooks``, ``sur-lab run --preset default``) passes on top of the notebook's own defaults. Only settings
    that change how a notebook runs, never what it measures, belong there (e.g. ``workers`` of a quality study)."""
    return _metadata_parameters(path, "suite_parameters")


def effective_parameters(notebook: Path, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters a run of ``notebook`` sees: the literal defaults of its ``parameters`` cell
    (:func:`sur_lab.runtime.params.literal_defaults`) overridden by ``parameters`` (e.g. :func:`suite_parameters` or
    :func:`smoke_parameters`, or a release manifest's). Used by the release's fingerprint and its sizes table
    (:mod:`sur_lab.runtime.sizes`)."""
    return {**literal_defaults(parameters_cell(notebook)), **dict(parameters)}


def declared_parameters(path: Path) -> dict:
    """Parameters declared in the notebook's ``parameters`` cell (papermill's inspection)."""
    return pm.inspect_notebook(str(path))


def failed_path(target: Path) -> Path:
    """``<name>.failed.ipynb`` beside ``target`` (``<name>.ipynb``)."""
    return target.with_name(target.stem + ".failed.ipynb")


def _mark_failed(source: Path, dest: Path, message: str) -> Path:
    """Move a partial notebook to ``dest`` with an error marker: a first markdown cell, ``metadata.sur_lab.run_error``
    and ``metadata.papermill.exception``; cells papermill left "running" are marked "failed"."""
    try:
        nb = nbformat.read(source, as_version=4)
    except Exception:  # noqa: BLE001 - a torn or missing partial notebook: keep the marker alone
        nb = nbformat.v4.new_notebook()
    nb.metadata.setdefault("sur_lab", {})["run_error"] = message
    nb.metadata.setdefault("papermill", {})["exception"] = True
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("papermill", {})
        if meta.get("status") == "running":
            meta["status"] = "failed"
    marker = nbformat.v4.new_markdown_cell(f"<span style=\"color:red\">**This run did not finish.** {message}</span>")
    marker.metadata["tags"] = ["sur-lab-run-error"]
    nb.cells.insert(0, marker)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    nbformat.write(nb, tmp)
    os.replace(tmp, dest)
    with contextlib.suppress(FileNotFoundError):
        if source != dest:
            source.unlink()
    return dest


def _recover_killed(target: Path) -> None:
    """Turn temporary files of runs whose process died (SIGKILL, power loss) into ``<name>.failed.ipynb``."""
    for tmp in sorted(target.parent.glob(f".{target.stem}.*{_RUNNING}")):
        try:
            pid = int(tmp.name[len(target.stem) + 2 : -len(_RUNNING)])
        except ValueError:
            continue
        if not _pid_alive(pid):
            _mark_failed(tmp, failed_path(target), f"killed: process {pid} died before the run finished")


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """Raise :class:`RunInterrupted` in the main thread on SIGTERM, so that cleanup runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise RunInterrupted(f"interrupted by signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _kernel_environment(values: dict[str, str | None]):
    """Set (or, for None, unset) environment variables while a kernel starts and runs: the kernel papermill starts
    inherits this process's environment. Restored afterwards."""
    previous = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def kernel_environment(outputs: Path, preset: str | None) -> dict[str, str | None]:
    """What the runner tells a kernel: the absolute outputs folder (``$SUR_LAB_OUTPUTS_DIR``: sweeps, tables and
    figures go beside the executed copy), the preset it runs (``$SUR_LAB_PRESET``; unset when not known), and that
    nobody will interact with it (:data:`sur_lab.analysis.plotting.STATIC_OUTPUTS_ENV`: views that offer an
    ipywidgets control write static HTML instead)."""
    return {"SUR_LAB_OUTPUTS_DIR": str(Path(outputs).absolute()), PRESET_ENV: preset, STATIC_OUTPUTS_ENV: "1"}


_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
_WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _progress_text(state: dict, model_id: str) -> str | None:
    """The final text of a tqdm notebook bar (an HBox of description HTML, a progress bar and the counts HTML), as
    tqdm prints it in a terminal; None when ``model_id`` is not such a bar."""
    box = state.get(model_id, {})
    children = box.get("state", {}).get("children", []) if box.get("model_name") == "HBoxModel" else []
    parts = [state.get(str(c).removeprefix("IPY_MODEL_"), {}) for c in children]
    if len(parts) != 3 or not parts[1].get("model_name", "").endswith("ProgressModel"):
        return None
    left, bar, right = (p.get("state", {}) for p in parts)
    total, value = bar.get("max") or 0, bar.get("value") or 0
    filled = int(round(10 * value / total)) if total else 0

    def text(v) -> str:
        return html.unescape(str(v or "")).replace("\u2007", " ")

    return f"{text(left.get('value'))}|{'█' * filled}{' ' * (10 - filled)}|{text(right.get('value'))}"


def final_progress_bars(nb) -> int:
    """Replace each tqdm progress-bar widget in an executed notebook by its final state as text (from the widget state
    nbclient saved), or drop the output when no state was saved: an executed copy has no live widgets, and a page
    rendered from it would show the bar frozen at 0 %. Returns the number of bars handled.

    Args:
        nb: an nbformat notebook, changed in place.
    """
    state = nb.metadata.get("widgets", {}).get(_WIDGET_STATE, {}).get("state", {})
    handled = 0
    for cell in nb.cells:
        outputs = []
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(_WIDGET_VIEW)
            if view is None:
                outputs.append(out)
                continue
            handled += 1
            final = _progress_text(state, view.get("model_id", ""))
            if final is not None:
                out["data"] = {"text/plain": final}
                outputs.append(out)
            elif "|" not in str(out["data"].get("text/plain", "")):  # another widget: keep its static fallback
                outputs.append(out)
        if "outputs" in cell:
            cell["outputs"] = outputs
    if not any(_WIDGET_VIEW in o.get("data", {}) for c in nb.cells for o in c.get("outputs", [])):
        nb.metadata.pop("widgets", None)
    return handled


def machine_stamp() -> dict:
    """Where a run happened: ``cpus`` (``os.cpu_count()``), ``platform``, ``python`` and ``torch`` versions, and
    ``load_1min`` (the 1-minute load average when the run finished: how busy the machine was). Stored as
    ``metadata.sur_lab.run`` of every executed copy, for the generated results page (:mod:`sur_lab.runtime.results_page`)."""
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpus": os.cpu_count(), "platform": platform.platform(terse=True), "python": platform.python_version(),
            "torch": torch_version, "load_1min": None if load is None else round(load, 2)}


def _stamp_machine(path: Path) -> None:
    """Stamp the executed copy with :func:`machine_stamp` and leave its progress bars in their final state."""
    nb = nbformat.read(path, as_version=4)
    nb.metadata.setdefault("sur_lab", {})["run"] = machine_stamp()
    final_progress_bars(nb)
    nbformat.write(nb, path)


def run_notebook(path: Path, parameters: dict | None = None, *, outputs: Path | None = None, progress: bool = True,
                 log_output: bool = False, preset: str | None = None) -> Path:
    """Execute one notebook with papermill into ``outputs/<name>.ipynb``, atomically.

    The notebook executes into ``.<name>.<pid>.running.ipynb`` and is renamed onto ``<name>.ipynb`` only when every
    cell ran. On a cell error or an interruption (Ctrl-C, SIGTERM) the partial copy becomes ``<name>.failed.ipynb``
    with an error marker and the exception propagates; the previous ``<name>.ipynb`` is left as it was.

    The outputs folder is made absolute before the kernel starts and given to it as ``$SUR_LAB_OUTPUTS_DIR``
    (:func:`kernel_environment`), so its sweeps, tables and figures land beside the executed copy.

    Args:
        path: the notebook.
        parameters: papermill parameters.
        outputs: folder for the executed copy and everything the notebook writes (default
            :func:`sur_lab.paths.outputs_dir`); a relative path is taken from the current directory.
        progress: show papermill's progress bar.
        log_output: stream cell output to the log.
        preset: the preset these parameters are (``"smoke"`` prints each notebook's plumbing-check banner); default:
            ``"smoke"`` when ``parameters`` are the notebook's smoke parameters, else not stated.

    Returns:
        Path of the executed copy ``outputs/<name>.ipynb``.

    Raises:
        ParameterError: when a parameter (given or default) does not match its annotation or lies outside its declared
            range (:func:`sur_lab.runtime.params.check_notebook_parameters`), before anything runs or is written.
        NotebookBusyError: when another process is running the same notebook into ``outputs`` (nothing is written).
        papermill.PapermillExecutionError: when a cell fails (see ``<name>.failed.ipynb``).
        RuntimeError: when :data:`KERNEL_START_ATTEMPTS` kernels in a row die before any cell runs
            (:func:`kernel_start_failed`; a single such death, a port race at startup, just starts a new kernel).
        KeyboardInterrupt: on Ctrl-C or SIGTERM (:class:`RunInterrupted`), after keeping ``<name>.failed.ipynb``.
    """
    path = Path(path)
    check_notebook_parameters(path, parameters)
    out_dir = (Path(outputs).expanduser() if outputs is not None else outputs_dir()).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    smoke = smoke_parameters(path)
    if preset is None and smoke and dict(parameters or {}) == smoke:
        preset = "smoke"
    target = out_dir / path.name
    lock = FileLock(str(out_dir / f".{path.stem}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise NotebookBusyError(
            f"notebook {path.name} is already running into {out_dir} (lock {lock.lock_file}); wait for it to finish "
            "or use another outputs folder"
        ) from None
    try:
        _recover_killed(target)
        tmp = out_dir / f".{path.stem}.{os.getpid()}{_RUNNING}"
        for attempt in range(1, KERNEL_START_ATTEMPTS + 1):
            try:
                with _sigterm_as_interrupt(), _kernel_environment(kernel_environment(out_dir, preset)):
                    pm.execute_notebook(
                        str(path), str(tmp), parameters=parameters or {}, cwd=str(path.parent), kernel_name="python3",
                        progress_bar=progress, log_output=log_output,
                    )
                break
            except BaseException as err:
                if attempt < KERNEL_START_ATTEMPTS and kernel_start_failed(err):
                    continue  # no cell ran: the kernel lost a port race at startup; start a new one
                kind = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
                _mark_failed(tmp, failed_path(target), f"{kind}: {type(err).__name__}: {err}".strip())
                raise
        _stamp_machine(tmp)
        os.replace(tmp, target)
        with contextlib.suppress(FileNotFoundError):
            failed_path(target).unlink()  # the last run succeeded: a stale failure marker would mislead
        return target
    finally:
        lock.release()


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
    parser.add_argument("--notebooks", type=Path, default=None, help="folder of notebooks (default: notebooks/)")
    parser.add_argument("--outputs", type=Path, default=None,
                        help="folder for the executed copies, sweeps, tables and figures (default: outputs/)")
    args = parser.parse_args(argv)
    overrides = {k: _literal(v) for k, v in args.p}
    paths = notebooks(args.only, args.notebooks)
    if not paths:
        print(f"no notebook matches {args.only!r} in {args.notebooks or NOTEBOOK_DIR}", file=sys.stderr)
        return 2
    declared = {path: declared_parameters(path) for path in paths}
    unknown = [name for name in overrides if not any(name in d for d in declared.values())]
    if unknown:
        names = ", ".join(p.name for p in paths)
        print(f"-p {unknown[0]}: no selected notebook declares a parameter named {unknown[0]!r} (selected: {names}); "
              "nothing was run", file=sys.stderr)
        return 2

    plans = {}
    for path in paths:
        params = smoke_parameters(path) if args.smoke else suite_parameters(path)
        params.update({k: v for k, v in overrides.items() if k in declared[path]})
        plans[path] = params
    problems = []
    for path, params in plans.items():  # every notebook's parameters, before any notebook runs
        try:
            check_notebook_parameters(path, params)
        except (ParameterError, ValueError) as err:
            problems.append(str(err))
    if problems:
        print("\n".join(problems) + "\nnothing was run", file=sys.stderr)
        return 2
    failures = []
    out = (args.outputs.expanduser() if args.outputs is not None else outputs_dir()).absolute()
    for path, params in plans.items():
        print(f"== {path.name} {params or '(defaults)'}", flush=True)
        t0 = time.perf_counter()
        try:
            target = run_notebook(path, params, outputs=out, preset="smoke" if args.smoke else None)
            print(f"   ok in {time.perf_counter() - t0:.0f} s -> {display_path(target)}", flush=True)
        except KeyboardInterrupt as err:
            print(f"   INTERRUPTED after {time.perf_counter() - t0:.0f} s ({err or 'Ctrl-C'}); partial run kept as "
                  f"{display_path(failed_path(out / path.name))}", flush=True)
            return 130
        except Exception as err:  # keep going: one failing notebook should not hide the others' results
            failures.append(path.name)
            print(f"   FAILED after {time.perf_counter() - t0:.0f} s: {type(err).__name__}: {err}", flush=True)
    print(f"{len(paths) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
