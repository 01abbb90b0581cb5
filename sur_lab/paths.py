"""Where sur_lab finds shared data and writes outputs, and how it writes them (atomically).

A leaf of the core layer: it imports nothing from sur_lab, so every layer may use it. The QA samples live beside the project (``../shared/data/qa``) and are never copied into the repository; a user can
point elsewhere with the ``SUR_LAB_DATA_DIR`` environment variable or by passing a path to a loader.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent  # sur_lab/
REPO_ROOT = PACKAGE_DIR.parent


def default_data_dir() -> Path:
    """Return the directory holding the multi-hop QA samples.

    Order: ``$SUR_LAB_DATA_DIR`` when set (and then only it: a user who names a folder never silently gets another
    one), else ``../shared/data/qa`` beside the repository root, then the same path beside the current working
    directory's parents (for notebooks run from ``notebooks/``).

    Raises:
        FileNotFoundError: naming ``SUR_LAB_DATA_DIR`` when it is set but is not a directory; else if none of the
            candidates exists (the message lists what was tried).
    """
    tried: list[Path] = []
    env = os.environ.get("SUR_LAB_DATA_DIR")
    if env:
        if not Path(env).expanduser().is_dir():
            raise FileNotFoundError(
                f"SUR_LAB_DATA_DIR={env!r} is not a directory; point it at the QA data folder (the one holding "
                "README.md, SHA256SUMS and hotpotqa/) or unset it to use ../shared/data/qa"
            )
        return Path(env).expanduser()
    tried.append(REPO_ROOT.parent / "shared" / "data" / "qa")
    cwd = Path.cwd().resolve()
    tried.extend(p / "shared" / "data" / "qa" for p in [cwd, *cwd.parents])
    tried = list(dict.fromkeys(tried))  # keep the order, drop repeats (the repository may sit in the cwd chain)
    for candidate in tried:
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        "QA data directory not found; set SUR_LAB_DATA_DIR or pass a path. Tried: " + ", ".join(map(str, tried))
    )


def outputs_dir(create: bool = True) -> Path:
    """Return ``<repo>/outputs`` (or ``$SUR_LAB_OUTPUTS_DIR``), creating it if asked."""
    out = Path(os.environ.get("SUR_LAB_OUTPUTS_DIR", REPO_ROOT / "outputs"))
    if create:
        out.mkdir(parents=True, exist_ok=True)
    return out


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
