"""The package layout is the architecture (ARCHITECTURE.md): lower layers never import higher ones.

Layers, lowest first: the core (top-level operator modules, ``allocators/``, ``executors/``), ``analysis/`` (which may
read ``runtime.paths``, a leaf), the runtime infrastructure (``runtime.paths``, ``runtime.sweep``), ``studies/``, and
the runtime entry points on top. Checked two
ways: statically (every import statement, including imports inside functions, in every module of a layer) and at run
time (importing the core and resolving every executor loads no module of a higher layer).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import sur_lab

PKG = Path(sur_lab.__file__).resolve().parent
HIGHER = {
    "core": ("sur_lab.analysis", "sur_lab.studies", "sur_lab.runtime"),
    "analysis": ("sur_lab.studies", "sur_lab.runtime.sweep", "sur_lab.runtime.run_notebooks", "sur_lab.runtime.cli"),
    "runtime-infrastructure": ("sur_lab.studies",),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(path: Path) -> str | None:
    rel = path.relative_to(PKG).parts
    if len(rel) == 1 or rel[0] in ("allocators", "executors"):
        return "core"
    if rel[0] == "analysis":
        return "analysis"
    if rel[0] == "runtime" and rel[-1] in ("paths.py", "sweep.py", "fingerprint.py", "__init__.py"):
        return "runtime-infrastructure"
    return None


def _imports(path: Path) -> list[str]:
    """Absolute names of every module an import statement in ``path`` can load (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return names


MODULES = sorted(p for p in PKG.rglob("*.py") if _layer(p) is not None)


def test_layers_cover_the_core_modules():
    core = {_module_name(p) for p in MODULES if _layer(p) == "core"}
    for name in ("sur_lab.models", "sur_lab.edits", "sur_lab.cache_ops", "sur_lab.budget", "sur_lab.units",
                 "sur_lab.forward", "sur_lab.answer", "sur_lab.repair", "sur_lab.allocators.sur",
                 "sur_lab.executors.sequential", "sur_lab.executors.packed", "sur_lab.executors.kernels.reference"):
        assert name in core


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_upward_imports(path):
    forbidden = HIGHER[_layer(path)]
    bad = [n for n in _imports(path) if n.startswith(forbidden)]
    assert not bad, f"{_module_name(path)} ({_layer(path)}) imports a higher layer: {bad}"


def test_importing_the_core_loads_no_study():
    code = (
        "import json, sys, sur_lab\n"
        "from sur_lab.executors import EXECUTORS, get_executor\n"
        "get_executor('sequential')\n"  # also imports the packed backends
        "import sur_lab.allocators.prior, sur_lab.allocators.signals, sur_lab.executors.kernels\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('sur_lab'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert "sur_lab.executors.packed" in loaded
    assert not [m for m in loaded if m.startswith(HIGHER["core"])], loaded


def test_public_api_is_importable_from_the_top_level():
    for name in sur_lab.__all__:
        assert getattr(sur_lab, name) is not None
