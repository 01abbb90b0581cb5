"""The package layout is the architecture (ARCHITECTURE.md): lower layers never import higher ones, and no modules
import each other in a loop.

Layers, lowest first: the core (top-level modules, ``allocators/``, ``executors/``; ``paths`` and ``fingerprint`` are
leaves of it), ``data/`` (the QA data layout and its fetcher), ``analysis/``, ``sweeps/``, ``studies/``, and ``runtime/`` (entry points) on top. Checked statically
over every import statement, including imports inside functions, and at run time (importing the core and resolving
every executor loads no module of a higher layer). Every module of the package belongs to a layer.

Within ``studies/``, no study imports another: a study is a top-level module or subpackage of ``sur_lab.studies``
(a subpackage's own modules belong to it), and the shared study infrastructure (:data:`SHARED_STUDY_MODULES`) belongs
to none. The data layer (``data/``) imports only the standard library, third-party packages and the core, also at run
time. Every module of ``studies/`` (a single-file study, a module of a study subpackage ``studies/<name>/``, the shared
infrastructure) has at most :data:`STUDY_MODULE_LINES` lines.

Imports sit at the top of their module; one inside a function needs an entry, with its reason, in
:data:`FUNCTION_LEVEL_IMPORTS` (issue 39).
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
#: Layers, lowest first; a module may import its own layer and the ones before it.
LAYERS = ("core", "data", "analysis", "sweeps", "studies", "runtime")
PACKAGES = {"data": "data", "analysis": "analysis", "sweeps": "sweeps", "studies": "studies", "runtime": "runtime"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in PACKAGES:
        return PACKAGES[parts[1]]
    return "core"  # sur_lab itself, its top-level modules, allocators/, executors/


MODULES = sorted(PKG.rglob("*.py"))
NAMES = {_module_name(p): p for p in MODULES}


def _imports(path: Path) -> list[str]:
    """The sur_lab modules an import statement in ``path`` loads, each resolved to the deepest existing module
    (``from sur_lab.x import f`` -> ``sur_lab.x``; ``from sur_lab import x`` -> ``sur_lab.x`` when it is a module)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [f"{mod}.{a.name}" for a in node.names] + [mod]
        else:
            continue
        for name in names:
            while name and name not in NAMES:
                name = name.rpartition(".")[0]
            if name.startswith("sur_lab"):
                found.append(name)
    return sorted(set(found))


GRAPH = {name: [m for m in _imports(path) if m != name] for name, path in NAMES.items()}

#: Modules of ``studies/`` that every study may import: the registry and the preset resolution (and the ``Study`` base
#: of issue 39 once it exists). Any other module of ``studies/`` belongs to exactly one study.
SHARED_STUDY_MODULES = frozenset({"sur_lab.studies", "sur_lab.studies.presets", "sur_lab.studies.base"})


def _study_of(module: str) -> str | None:
    """The study a module belongs to (``sur_lab.studies.noprefix.study`` -> ``noprefix``), or None outside
    ``studies/`` and for :data:`SHARED_STUDY_MODULES`."""
    parts = module.split(".")
    if module in SHARED_STUDY_MODULES or len(parts) < 3 or parts[1] != "studies":
        return None
    return parts[2]


def test_layers_cover_the_core_modules():
    core = {n for n in NAMES if _layer_of(n) == "core"}
    for name in ("sur_lab.models", "sur_lab.edits", "sur_lab.cache_ops", "sur_lab.budget", "sur_lab.units",
                 "sur_lab.forward", "sur_lab.answer", "sur_lab.repair", "sur_lab.paths", "sur_lab.fingerprint",
                 "sur_lab.allocators.sur", "sur_lab.executors.sequential", "sur_lab.executors.packed",
                 "sur_lab.executors.kernels.reference"):
        assert name in core
    for name in ("sur_lab.sweeps.record", "sur_lab.sweeps.case", "sur_lab.sweeps.store", "sur_lab.sweeps.local",
                 "sur_lab.sweeps.ray"):
        assert _layer_of(name) == "sweeps"
    # runtime/ holds the entry points only
    assert {n for n in NAMES if _layer_of(n) == "runtime"} == {
        "sur_lab.runtime", "sur_lab.runtime.bench", "sur_lab.runtime.claims", "sur_lab.runtime.cli",
        "sur_lab.runtime.params", "sur_lab.runtime.release", "sur_lab.runtime.results_page", "sur_lab.runtime.run_notebooks",
        "sur_lab.runtime.sizes"}


@pytest.mark.parametrize("name", sorted(NAMES), ids=lambda n: n.removeprefix("sur_lab."))
def test_no_upward_imports(name):
    rank = LAYERS.index(_layer_of(name))
    bad = [m for m in GRAPH[name] if LAYERS.index(_layer_of(m)) > rank]
    assert not bad, f"{name} ({_layer_of(name)}) imports a higher layer: {bad}"


def test_study_of_names_the_owning_study():
    assert _study_of("sur_lab.studies.niah") == "niah"
    assert _study_of("sur_lab.studies.noprefix.selection") == _study_of("sur_lab.studies.noprefix") == "noprefix"
    assert _study_of("sur_lab.studies.presets") is None and _study_of("sur_lab.studies") is None
    assert _study_of("sur_lab.data.qa") is None and _study_of("sur_lab.sweeps.case") is None
    studies = {_study_of(n) for n in NAMES} - {None}
    assert {"niah", "natural_qa", "bench", "evidence_location", "execution_paths", "stale_facts", "noprefix",
            "theory", "agent_traces", "agent_session", "staleness"} <= studies
    assert "datasets" not in studies  # the QA loaders are the data layer's (sur_lab.data.qa)


@pytest.mark.parametrize("name", sorted(n for n in NAMES if _study_of(n)), ids=lambda n: n.removeprefix("sur_lab."))
def test_no_study_imports_another_study(name):
    own = _study_of(name)
    bad = [m for m in GRAPH[name] if _study_of(m) not in (None, own)]
    assert not bad, f"{name} (study {own}) imports another study: {bad}; move the shared piece down (data/, " \
                    f"analysis/, sweeps/)"


#: The most lines a module of ``studies/`` may have (issue 39, item 3: "no study module over ~600 lines"): a study that
#: grows past it is split into a subpackage (``cases``, ``study``, ``report``, ...).
STUDY_MODULE_LINES = 650


def _in_study_package(path: Path) -> bool:
    """Whether ``path`` is a module of a study subpackage (``studies/<name>/...``, its ``__init__`` included)."""
    return len(path.relative_to(PKG / "studies").parts) >= 2 if path.is_relative_to(PKG / "studies") else False


@pytest.mark.parametrize("name", sorted(n for n in NAMES if _layer_of(n) == "studies"),
                         ids=lambda n: n.removeprefix("sur_lab."))
def test_study_modules_stay_small(name):
    lines = len(NAMES[name].read_text().splitlines())
    assert lines <= STUDY_MODULE_LINES, f"{name} has {lines} lines (> {STUDY_MODULE_LINES}); divide it into (or within) " \
                                        f"its study's subpackage"


def test_study_package_rule_covers_the_split_studies():
    packaged = {_study_of(n) for n, p in NAMES.items() if _in_study_package(p)}
    assert {"niah", "natural_qa", "evidence_location", "bench", "stale_facts", "noprefix", "theory",
            "agent_traces"} <= packaged
    assert _in_study_package(NAMES["sur_lab.studies.niah.matched"]) and _in_study_package(NAMES["sur_lab.studies.niah"])
    assert not _in_study_package(NAMES["sur_lab.studies.base"]) and not _in_study_package(NAMES["sur_lab.studies"])


@pytest.mark.parametrize("name", sorted(n for n in NAMES if _layer_of(n) == "data"),
                         ids=lambda n: n.removeprefix("sur_lab."))
def test_data_imports_only_the_core_and_itself(name):
    bad = [m for m in GRAPH[name] if _layer_of(m) not in ("core", "data")]
    assert not bad, f"{name} (data) imports a higher layer: {bad}"


def test_importing_the_data_layer_loads_no_higher_layer():
    code = (
        "import json, sys\n"
        "import sur_lab.data, sur_lab.data.layout, sur_lab.data.qa, sur_lab.data.text, sur_lab.data.fetch\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('sur_lab'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert {"sur_lab.data.qa", "sur_lab.data.text"} <= set(loaded)
    assert not [m for m in loaded if _layer_of(m) not in ("core", "data")], loaded


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), i.e. modules importing each other in a
    loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _cycles({"a": ["b"], "b": []}) == []


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


#: Tiers inside the core, lowest first (ARCHITECTURE.md): the operators (models, edits, cache_ops, budget, forward,
#: answer, repair, allocators/, executors/, ...) at 0; the session at 1 (``live_cache`` owns the live cache, ``sync``
#: diffs prompts, ``session`` holds the conversation); the correctness gate at 2 (``model_check`` runs sessions and
#: registers itself with ``session``, which never imports it); the package's public API (``sur_lab/__init__.py``) on
#: top. A module imports its own tier and the ones below.
CORE_TIERS = {"sur_lab.live_cache": 1, "sur_lab.sync": 1, "sur_lab.session": 1, "sur_lab.model_check": 2, "sur_lab": 3}


def _tier(module: str) -> int:
    return CORE_TIERS.get(module, 0)


@pytest.mark.parametrize("name", sorted(n for n in NAMES if _layer_of(n) == "core"), ids=lambda n: n.removeprefix(
    "sur_lab.") or "sur_lab")
def test_core_tiers(name):
    bad = [m for m in GRAPH[name] if _layer_of(m) == "core" and _tier(m) > _tier(name)]
    assert not bad, f"{name} (core tier {_tier(name)}) imports a higher tier: {bad}"


def test_model_check_sits_above_the_session():
    assert "sur_lab.session" in GRAPH["sur_lab.model_check"]
    below = {"sur_lab.session", "sur_lab.live_cache", "sur_lab.sync"}
    seen, todo = set(), list(below)
    while todo:  # everything the session loads, transitively
        for m in GRAPH[todo.pop()]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    assert "sur_lab.model_check" not in seen


def test_sync_imports_no_allocator():
    """``sync`` carries a :class:`sur_lab.budget.Selection` in its record; it needs no allocator for the type."""
    assert not [m for m in GRAPH["sur_lab.sync"] if m.startswith("sur_lab.allocators")], GRAPH["sur_lab.sync"]


def test_importing_the_core_loads_no_higher_layer():
    code = (
        "import json, sys, sur_lab\n"
        "from sur_lab.executors import EXECUTORS, get_executor\n"
        "get_executor('sequential')\n"  # also imports the packed backends
        "import sur_lab.allocators.prior, sur_lab.allocators.signals, sur_lab.executors.kernels\n"
        "import sur_lab.paths, sur_lab.fingerprint\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('sur_lab'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert "sur_lab.executors.packed" in loaded
    assert not [m for m in loaded if _layer_of(m) != "core"], loaded


def test_public_api_is_importable_from_the_top_level():
    """``sur_lab.__all__`` is the user-facing surface (issue 39): load, edit, prepare / repair / recover, answer,
    sessions and sync, the registries, the result types and check_model; every helper is imported from its module."""
    assert len(sur_lab.__all__) == 22 and len(set(sur_lab.__all__)) == 22
    assert {"load_model", "chat_edit", "prepare", "repair", "recover", "answer", "EditSession", "SyncPolicy",
            "ALLOCATORS", "EXECUTORS", "RepairResult", "check_model"} <= set(sur_lab.__all__)
    namespace: dict = {}
    exec("from sur_lab import *", namespace)
    assert sorted(n for n in namespace if n != "__builtins__") == sorted(sur_lab.__all__)
    for name in sur_lab.__all__:
        assert getattr(sur_lab, name) is not None
    public = {n for n in vars(sur_lab) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(sur_lab, n)).__name__ == "module"}
    assert public - modules == set(sur_lab.__all__), "a top-level name outside __all__"


#: Reasons a module of the package may import inside a function (issue 39: top-level imports except for optional
#: dependencies); every other import is at the top of its module, where it shows the module's dependencies.
_TRITON = "optional dependency: sur_lab.executors.kernels imports Triton (the 'triton' extra) when it is installed"
_CLI = "import cost: a sur-lab subcommand loads its own stack; `sur-lab --help` and `sur-lab data` load only the core"
#: ``(importing module, imported module) -> reason``.
FUNCTION_LEVEL_IMPORTS = {
    ("sur_lab.allocators.controls", "bm25s"): "import cost: `import sur_lab` loads this module; bm25s only BM25 needs",
    ("sur_lab.attention", "transformers.modeling_utils"): "import cost: ~1,500 modules `import sur_lab` does not need",
    ("sur_lab.attention", "transformers"): "import cost: AttentionInterface loads transformers.modeling_utils",
    ("sur_lab.attention", "transformers.masking_utils"): "import cost: as transformers.modeling_utils",
    ("sur_lab.models", "transformers"): "import cost: the Auto classes take ~0.3 s that `import sur_lab` need not pay",
    ("sur_lab.data.qa", "datasets"): "optional dependency: only a hub source needs it (and it is slow to import)",
    ("sur_lab.executors.kernels.onepass", "torch.utils"): "import cost: cpp_extension only compiles the kernel",
    ("sur_lab.executors.packed", "sur_lab.executors.kernels"): _TRITON,
    ("sur_lab.executors.packed", "sur_lab.executors.kernels.indexed_attention"): _TRITON,
    ("sur_lab.executors.packed", "sur_lab.executors.kernels.onepass"): _TRITON,
    ("sur_lab.runtime.release", "psutil"): "optional dependency: psutil is not a requirement of sur_lab",
    ("sur_lab.runtime.release", "resource"): "POSIX only: the standard library's resource is not on Windows",
    ("sur_lab.sweeps.ray", "ray"): "optional dependency: the 'distributed' extra",
    **{("sur_lab.runtime.cli", m): _CLI for m in (
        "nbformat", "sur_lab.runtime.bench", "sur_lab.runtime.release", "sur_lab.runtime.run_notebooks",
        "sur_lab.studies", "sur_lab.studies.presets", "sur_lab.sweeps", "sur_lab.sweeps.ray", "sur_lab.sweeps.store")},
}


def _function_level_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, imported module)`` of each import statement inside a function of ``path`` (relative imports
    resolved; ``from a.b import c`` -> ``a.b``)."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []

    def walk(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names)
            elif inside and isinstance(child, ast.ImportFrom):
                base = package[: len(package) - child.level + 1] if child.level else []
                found.append((child.lineno, ".".join(base + ([child.module] if child.module else []))))
            walk(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(ast.parse(path.read_text()), False)
    return found


def test_function_level_import_finder():
    got = _function_level_imports(PKG / "sweeps" / "ray.py")
    assert ("ray" in [m for _, m in got]) and all(isinstance(line, int) for line, _ in got)


def test_function_level_imports_have_a_reason():
    """An import inside a function hides a dependency: it needs an entry (and a reason) in
    :data:`FUNCTION_LEVEL_IMPORTS`, and the entries all still occur."""
    unlisted, used = [], set()
    for name, path in NAMES.items():
        for line, module in _function_level_imports(path):
            if (name, module) in FUNCTION_LEVEL_IMPORTS:
                used.add((name, module))
            else:
                unlisted.append(f"{path.relative_to(PKG.parent)}:{line}: {module}")
    assert not unlisted, (f"{len(unlisted)} function-level import(s) without a reason; import at the top of the "
                          f"module, or add the pair and its reason to FUNCTION_LEVEL_IMPORTS: {unlisted}")
    assert set(FUNCTION_LEVEL_IMPORTS) == used, f"entries that no longer occur: {set(FUNCTION_LEVEL_IMPORTS) - used}"
    assert all(reason.strip() for reason in FUNCTION_LEVEL_IMPORTS.values())
