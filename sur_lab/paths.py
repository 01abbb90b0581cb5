"""Where sur_lab finds shared data and writes outputs, and how it writes them (atomically).

A leaf of the core layer: it imports nothing from sur_lab, so every layer may use it. The QA samples live beside the
project (``../shared/data/qa``) and are never copied into the repository; a clone without them gets them with
``sur-lab data fetch`` (:mod:`sur_lab.data.fetch`), and a user can point elsewhere with the ``SUR_LAB_DATA_DIR``
environment variable or by passing a path to a loader.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent  # sur_lab/
REPO_ROOT = PACKAGE_DIR.parent


#: The variable that names the QA data folder (and then only it) and where ``sur-lab data fetch`` writes.
DATA_DIR_ENV = "SUR_LAB_DATA_DIR"


def fetched_data_dir() -> Path:
    """Where ``sur-lab data fetch`` writes the QA data by default, and the last place :func:`default_data_dir` looks:
    ``$SUR_LAB_DATA_DIR`` when set, else ``data/qa`` under the user's sur_lab cache (``$SUR_LAB_CACHE``, default
    ``~/.cache/sur_lab``, the folder that also holds the dequantized models). ``~`` is expanded and a relative path is
    made absolute from the current directory."""
    env = os.environ.get(DATA_DIR_ENV, "").strip()
    if env:
        return Path(env).expanduser().absolute()
    cache = os.environ.get("SUR_LAB_CACHE", "").strip()
    return (Path(cache).expanduser().absolute() if cache else Path.home() / ".cache" / "sur_lab") / "data" / "qa"


def data_dir_candidates() -> list[Path]:
    """The folders :func:`default_data_dir` tries, in order, without checking them: ``$SUR_LAB_DATA_DIR`` alone when
    it is set; else ``../shared/data/qa`` beside the repository root, the same path beside the current directory and
    its parents (for notebooks run from ``notebooks/``), then :func:`fetched_data_dir` (what ``sur-lab data fetch``
    fills)."""
    if os.environ.get(DATA_DIR_ENV, "").strip():
        return [fetched_data_dir()]
    cwd = Path.cwd().resolve()
    tried = [REPO_ROOT.parent / "shared" / "data" / "qa"]
    tried.extend(p / "shared" / "data" / "qa" for p in [cwd, *cwd.parents])
    tried.append(fetched_data_dir())
    return list(dict.fromkeys(tried))  # keep the order, drop repeats (the repository may sit in the cwd chain)


def default_data_dir() -> Path:
    """Return the directory holding the multi-hop QA samples: the first of :func:`data_dir_candidates` that exists.

    The copy beside the project (``../shared/data/qa``) is found first; a clone without it reads what ``sur-lab data
    fetch`` wrote. ``$SUR_LAB_DATA_DIR``, when set, is the only candidate (a user who names a folder never silently
    gets another one).

    Raises:
        FileNotFoundError: naming ``SUR_LAB_DATA_DIR`` when it is set but is not a directory; else if none of the
            candidates exists (the message lists what was tried and names ``sur-lab data fetch``).
    """
    env = os.environ.get(DATA_DIR_ENV, "").strip()
    if env:
        if not Path(env).expanduser().is_dir():
            raise FileNotFoundError(
                f"SUR_LAB_DATA_DIR={env!r} is not a directory; run `sur-lab data fetch` to download the QA data into "
                "it, point it at a QA data folder (the one holding SHA256SUMS and hotpotqa/), or unset it to use "
                "../shared/data/qa"
            )
        return Path(env).expanduser()
    tried = data_dir_candidates()
    fetched = fetched_data_dir()
    for candidate in tried:
        # the fetch folder counts once a fetch finished (it writes SHA256SUMS last); a shared copy once it exists
        if candidate.is_dir() and (candidate != fetched or (candidate / "SHA256SUMS").is_file()):
            return candidate
    raise FileNotFoundError(
        "QA data directory not found: run `sur-lab data fetch` to download the datasets' official releases into "
        f"{fetched_data_dir()} (or set SUR_LAB_DATA_DIR to a QA data folder, or pass a path). Tried: "
        + ", ".join(map(str, tried))
    )


def run_tag(**params: Any) -> str:
    """A file-name-safe tag from parameter values (the run-specific part of output and sweep folder names), e.g. ``run_tag(model="x/y", n=10)`` -> ``"model-x-y_n-10"``."""
    parts = []
    for key, value in params.items():
        if isinstance(value, (list, tuple)):
            value = "-".join(str(v) for v in value)
        parts.append(f"{key}-{value}")
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", "_".join(parts)).strip("-")


def outputs_dir(create: bool = True) -> Path:
    """Return ``<repo>/outputs`` (or ``$SUR_LAB_OUTPUTS_DIR``), absolute, creating it if asked.

    A relative ``$SUR_LAB_OUTPUTS_DIR`` is taken from the current directory when this is called; the notebook runner
    hands its kernels an absolute one (they run in ``notebooks/``), so a notebook writes where the runner was told.
    """
    env = os.environ.get("SUR_LAB_OUTPUTS_DIR", "").strip()
    out = Path(env).expanduser().absolute() if env else REPO_ROOT / "outputs"
    if create:
        out.mkdir(parents=True, exist_ok=True)
    return out


def display_path(path: Path | str) -> str:
    """``path`` as a notebook or a command prints it: relative to the repository root when it lies inside it
    (``build/docs-run/sweeps/niah_...``, the same from any working directory), else as given (absolute paths stay
    absolute)."""
    path = Path(path)
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` when the block succeeds, delete it otherwise.

    Readers therefore see either the previous file or the complete new one, never a torn one (``os.replace`` is atomic
    within a file system), and a failed write leaves the previous file in place. The temporary name is
    ``.<name>.<pid>.<thread>.tmp``, unique per writer. Writers that infer a format from the suffix must be told the
    format explicitly (e.g. ``fig.savefig(tmp, format="png")``).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
