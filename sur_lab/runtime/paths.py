"""Where sur_lab finds shared data and writes outputs.

The QA samples live beside the project (``../shared/data/qa``) and are never copied into the repository; a user can
point elsewhere with the ``SUR_LAB_DATA_DIR`` environment variable or by passing a path to a loader.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # sur_lab/
REPO_ROOT = PACKAGE_DIR.parent


def default_data_dir() -> Path:
    """Return the directory holding the multi-hop QA samples.

    Order: ``$SUR_LAB_DATA_DIR``, then ``../shared/data/qa`` beside the repository root, then the same path beside
    the current working directory's parents (for notebooks run from ``notebooks/``).

    Raises:
        FileNotFoundError: if none of the candidates exists; the message lists what was tried.
    """
    tried: list[Path] = []
    env = os.environ.get("SUR_LAB_DATA_DIR")
    if env:
        tried.append(Path(env))
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
