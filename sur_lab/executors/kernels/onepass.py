"""One-pass packed attention on the CPU: a C++ kernel that reads each K/V tile once for every row that sees it.

Packed attention (Eq. 22, appendix 13.2): B query rows at sorted absolute positions U = (u_1 < ... < u_B), row r
attending keys ``0..u_r``. torch's CPU flash kernel, which the key-split SDPA path calls, re-reads every key of a call
once per block of 32-256 query rows, so keys seen by few packed rows cost more per row-key than the arithmetic
(issue 17). This kernel inverts the loop: for each K/V tile it updates the online-softmax state (running max, sum,
FP32 accumulator; Dao et al. 2022) of every packed row that sees the tile, with one score GEMM and one ``P V`` GEMM
over all those rows, so each tile is read from memory once per KV head.

Plan (:func:`build_onepass_plan`, once per refresh, O(B + N / 64), reused by every layer): the 64-key tiles of Eq.
23-24 at row granularity. Row r visits tile c iff ``u_r >= 64 c`` (``c < n_total(r) = ceil((u_r + 1) / 64)``) and
sees it complete, with no per-element test, iff ``u_r + 1 >= 64 (c + 1)`` (``c < n_full(r) = floor((u_r + 1) /
64)``); in the tile where its causal limit falls it sees keys ``j <= u_r`` only. Sorted rows make the visiting rows
of a tile a suffix of the rows. Consecutive tiles visited by the same rows are merged into one GEMM tile of at most
:data:`ONEPASS_TILE_SCORES` scores and :data:`ONEPASS_MAX_TILE_KEYS` keys, so at most one 64-key tile per merged tile
carries row ends and no row computes more than 63 masked keys per causal limit.

The GQA group is folded into the rows in (row, group) order (query head h reads KV head ``h // (Hq / Hkv)``, the
``repeat_kv`` mapping). Rows are cut into chunks of at most :data:`ONEPASS_CHUNK_ROWS` folded rows (their state stays
in cache; each chunk reads the tiles its rows see) and enough chunks for every thread; ATen's ``parallel_for``
(OpenMP) runs (KV head, chunk) items. float32, bfloat16 and float16 compute in float32 (K/V tiles widened once,
output rounded once), float64 in float64.

Build: ``torch.utils.cpp_extension.load`` compiles ``onepass.cpp`` on first use (about 10 s on 2 cores; ``make
install`` does not build it) into ``<model cache>/kernels/onepass-<fingerprint>/`` (``$SUR_LAB_CACHE`` or
``~/.cache/sur_lab``, :func:`sur_lab.models.cache_root`). The fingerprint (:func:`onepass_fingerprint`) covers the
source, torch's version, the compiler and its version, the flags (ISA flags from torch's CPU capability) and the
platform; later processes load the built library without compiling. A failed build or load (no compiler, no BLAS
symbol, an unsupported platform) never raises: :func:`onepass_available` returns False after one warning line and the
callers fall back (:func:`onepass_attention` to :func:`~sur_lab.executors.kernels.packed_sdpa_reference`, the
``"cpp"`` packed backend to the key-split SDPA path). ``SUR_LAB_NO_CPP_KERNEL=1`` disables it.

Integrity: a damaged library must not crash a process (``dlopen`` of a truncated file dies of SIGBUS, with no Python
error, in every later process while the file stays). A build runs in a fresh folder; the library is loaded once in a
subprocess (it must load and register ``torch.ops.sur_lab_onepass.attention``), and only then are its
manifest (:data:`MANIFEST_FILE`: size, sha256, torch version, compiler, source, flags, platform) and the folder
renamed into place, atomically. Before any process loads the cached library it checks it against the manifest
(:func:`verify_library`); a missing or unreadable manifest or any mismatch (a truncated file, another library in its
place, another torch) rebuilds it once, and a failed rebuild falls back with one warning naming the file. After loading,
the op must be registered, or the kernel is unavailable (one warning naming the file).

Source: Eq. 22-24, appendix 13.2.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from sur_lab.executors.kernels.reference import as_positions, check_attention_shapes, packed_sdpa_reference
from sur_lab.models import cache_root

__all__ = [
    "ONEPASS_BLOCK_N",
    "ONEPASS_CHUNK_ROWS",
    "ONEPASS_DTYPES",
    "ONEPASS_MAX_TILE_KEYS",
    "ONEPASS_TILE_SCORES",
    "MANIFEST_FILE",
    "OnePassPlan",
    "build_onepass_plan",
    "onepass_attention",
    "onepass_available",
    "onepass_build_dir",
    "onepass_fingerprint",
    "onepass_unavailable_reason",
    "verify_library",
]

#: Key tile of the plan (the 64 of Eq. 23-24); merged tiles are multiples of it.
ONEPASS_BLOCK_N = 64
#: Scores (folded rows x keys) per merged tile: few rows get long tiles so each GEMM keeps a useful size. Chosen on
#: this project's 2-core CPU (SmolLM2 heads, N = 8K, B = 64 and the 5 % support; ``scripts/attention_paths.py``):
#: 64K-256K run within 3 % of each other, 16K is 5-10 % slower.
ONEPASS_TILE_SCORES = 131072
#: Keys per merged tile, at most.
ONEPASS_MAX_TILE_KEYS = 4096
#: Folded query rows per chunk, at most: a chunk's Q, accumulator and scores stay in a core's L2 cache.
ONEPASS_CHUNK_ROWS = 512
#: Input dtypes of the kernel.
ONEPASS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_SOURCE = Path(__file__).with_name("onepass.cpp")
_NAME = "sur_lab_onepass"
#: The manifest beside the built library: its size and sha256 and what it was built from (module docstring).
MANIFEST_FILE = "manifest.json"
_LOCK = threading.Lock()
_STATE: bool | None = None  # None: not tried in this process; True: loaded; False: unavailable (see _REASON)
_REASON = ""


# ------------------------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True, eq=False)  # eq=False: tensor fields compare elementwise
class OnePassPlan:
    """Per-refresh tile plan of :func:`onepass_attention`, reusable across layers (Eq. 23-24 at row granularity).

    Attributes:
        positions: ``[B]`` int64 CPU, sorted strictly increasing absolute positions U (tokens).
        bounds: ``[C + 1]`` int64 CPU key boundaries of the merged tiles, ``0 = bounds[0] < ... < bounds[C] = u_B +
            1``; every inner boundary is a multiple of ``block_n``.
        group: query heads per KV head the tiles were sized for (folded rows = rows x group).
        block_n: the key tile (64, Eq. 23-24).
        max_position: u_B (-1 when B = 0).
    """

    positions: torch.Tensor
    bounds: torch.Tensor
    group: int
    block_n: int
    max_position: int

    @property
    def num_rows(self) -> int:
        """B, the packed rows."""
        return self.positions.numel()

    @property
    def num_tiles(self) -> int:
        """C, the merged key tiles (one score GEMM and one ``P V`` GEMM each per KV head and row chunk)."""
        return max(self.bounds.numel() - 1, 0)


def build_onepass_plan(
    positions: torch.Tensor | Sequence[int],
    *,
    group: int = 1,
    block_n: int | None = None,
    tile_scores: int | None = None,
    max_tile_keys: int | None = None,
) -> OnePassPlan:
    """Build the one-pass tile plan in O(B + u_B / block_n), without a B x N mask (Eq. 23-24).

    Tile c covers keys ``[c * block_n, (c + 1) * block_n)``; its visiting rows are those with ``u_r >= c *
    block_n`` (``n_total`` of Eq. 24 per row), a suffix of the sorted rows. A new merged tile starts where the
    visiting rows change (a causal limit fell in the previous tile) or where the current one would exceed
    ``tile_scores`` folded-row scores (at least one tile) or ``max_tile_keys`` keys.

    Args:
        positions: ``[B]`` sorted unique non-negative absolute positions U (tokens), any integer dtype or a sequence.
        group: query heads per KV head (>= 1); sizes the tiles only (any plan gives the same result).
        block_n: key tile (>= 1); None: :data:`ONEPASS_BLOCK_N` (64, as in Eq. 23-24).
        tile_scores: folded-row scores per merged tile (>= 1); None: :data:`ONEPASS_TILE_SCORES`.
        max_tile_keys: keys per merged tile (>= ``block_n``); None: :data:`ONEPASS_MAX_TILE_KEYS`.

    Returns:
        :class:`OnePassPlan` on the CPU.

    Raises:
        ValueError: naming ``positions`` (see :func:`sur_lab.executors.kernels.reference.as_positions`), ``group``,
            ``block_n``, ``tile_scores`` or ``max_tile_keys`` when out of range.
    """
    # Module attributes read at call time (tests shrink the tiles of the tiny models).
    block_n = ONEPASS_BLOCK_N if block_n is None else block_n
    tile_scores = ONEPASS_TILE_SCORES if tile_scores is None else tile_scores
    max_tile_keys = max(ONEPASS_MAX_TILE_KEYS, block_n) if max_tile_keys is None else max_tile_keys
    for name, value, low in (("group", group, 1), ("block_n", block_n, 1), ("tile_scores", tile_scores, 1)):
        if not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if not isinstance(max_tile_keys, (int, np.integer)) or max_tile_keys < block_n:
        raise ValueError(f"max_tile_keys={max_tile_keys!r} must be an integer >= block_n={block_n}")
    pos = as_positions(positions).cpu().clone()  # the frozen plan must not see later edits of the caller's tensor
    b = pos.numel()
    if b == 0:
        return OnePassPlan(pos, torch.zeros(1, dtype=torch.int64), int(group), int(block_n), -1)
    u = pos.numpy()
    end = int(u[-1]) + 1
    num_blocks = -(-end // block_n)
    first = np.searchsorted(u, np.arange(num_blocks, dtype=np.int64) * block_n, side="left")  # visiting rows: first..
    max_blocks = max_tile_keys // block_n
    bounds, start = [0], 0
    for c in range(1, num_blocks):
        rows = (b - int(first[start])) * group
        cap = max(1, min(max_blocks, tile_scores // (rows * block_n)))
        if first[c] != first[c - 1] or c - start >= cap:
            bounds.append(c * block_n)
            start = c
    bounds.append(end)
    return OnePassPlan(pos, torch.tensor(bounds, dtype=torch.int64), int(group), int(block_n), int(u[-1]))


# ---------------------------------------------------------------------------------------------------------- kernel


def onepass_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions_or_plan: OnePassPlan | torch.Tensor | Sequence[int],
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Packed causal attention with the one-pass C++ kernel (Eq. 22).

    Args:
        q: ``[1, Hq, B, D]`` queries of the packed rows (after RoPE), a dtype of :data:`ONEPASS_DTYPES`, on the CPU;
            any strides.
        k: ``[1, Hkv, N, D]`` keys of the layer cache (fresh rows written, Eq. 21), q's dtype, Hq a multiple of Hkv.
        v: ``[1, Hkv, N, D]`` values, like k.
        positions_or_plan: an :class:`OnePassPlan` (reuse it across layers) or ``[B]`` sorted unique positions (a
            plan is built per call then).
        scale: softmax scale; defaults to ``1 / sqrt(D)``.

    Returns:
        ``[1, Hq, B, D]`` in q's dtype, a transposed view of a contiguous ``[1, B, Hq, D]`` buffer (the layout
        attention modules return): ``O_r = softmax(q_r K_{0:u_r}^T * scale) V_{0:u_r}``. Scores, probabilities and
        accumulation in FP32 (FP64 for FP64 inputs). Where the kernel is unavailable (:func:`onepass_available`):
        :func:`~sur_lab.executors.kernels.reference.packed_sdpa_reference` (contiguous ``[1, Hq, B, D]``).

    Raises:
        ValueError: naming ``q``/``k``/``v`` (ranks, batch, heads, dims, dtypes, devices; see
            :func:`~sur_lab.executors.kernels.reference.check_attention_shapes`) or ``positions`` (unsorted,
            duplicated, negative, >= N, a row count other than B), before any work.

    Source: Eq. 22-24, appendix 13.2.
    """
    plan = positions_or_plan if isinstance(positions_or_plan, OnePassPlan) else None
    if plan is None:
        pos = as_positions(positions_or_plan)
        _, hkv, _, _, _ = check_attention_shapes(q, k, v, pos.numel(), int(pos[-1]) if pos.numel() else -1)
        plan = build_onepass_plan(pos, group=q.shape[1] // hkv)
    check_attention_shapes(q, k, v, plan.num_rows, plan.max_position)
    if q.dtype not in ONEPASS_DTYPES:
        raise ValueError(f"q dtype must be one of {', '.join(map(str, ONEPASS_DTYPES))}, got {q.dtype}")
    if q.device.type != "cpu":
        raise ValueError(f"q, k, v must be CPU tensors for the one-pass kernel, got {q.device}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not onepass_available():
        return packed_sdpa_reference(q, k, v, plan.positions, scale=scale)
    return _attend(q, k, v, plan, scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: OnePassPlan, scale: float) -> torch.Tensor:
    """The kernel call without validation (the packed executor's per-layer path; the C++ side checks bounds)."""
    return torch.ops.sur_lab_onepass.attention(q, k, v, plan.positions, plan.bounds, scale, ONEPASS_CHUNK_ROWS)


# ----------------------------------------------------------------------------------------------------------- build


def _isa_flags() -> list[str]:
    """Vector ISA flags from torch's own CPU capability (what its kernels dispatch to on this machine)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"]
    if capability == "AVX2":
        return ["-mavx2", "-mfma"]
    return []


def _cflags() -> list[str]:
    return ["-O3", "-fopenmp", *_isa_flags()]


def _compiler_identity() -> str:
    """The C++ compiler torch's extension builder uses (``$CXX`` or ``c++``) and its ``--version`` line.

    Raises:
        OSError, subprocess.SubprocessError: when it cannot be run (handled by :func:`onepass_available`).
    """
    compiler = os.environ.get("CXX", "c++")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=60)
    return f"{compiler}: {version.stdout.splitlines()[0] if version.stdout else ''}"


def _build_inputs() -> dict:
    """What the built library depends on: source hash, torch version, compiler, flags, platform.

    Raises:
        OSError, subprocess.SubprocessError: when the compiler cannot be run.
    """
    return {
        "source": hashlib.sha256(_SOURCE.read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "compiler": _compiler_identity(),
        "cflags": _cflags(),
        "platform": f"{platform.system()}-{platform.machine()}",
    }


def onepass_fingerprint() -> str:
    """Hex fingerprint of what the built library depends on: source, torch version, compiler, flags, platform.

    Raises:
        OSError, subprocess.SubprocessError: when the compiler cannot be run.
    """
    return _digest(_build_inputs())


def _digest(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def onepass_build_dir() -> Path:
    """``<model cache>/kernels/onepass-<fingerprint>`` (:func:`sur_lab.models.cache_root`).

    Raises:
        OSError, subprocess.SubprocessError: when the compiler cannot be run (the fingerprint names it).
    """
    return _build_dir(_build_inputs())


def _build_dir(inputs: dict) -> Path:
    return cache_root() / "kernels" / f"onepass-{_digest(inputs)}"


def _sha256_file(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def verify_library(folder: Path, inputs: dict | None = None) -> str | None:
    """Why the library cached in ``folder`` must not be loaded, or ``None`` when its manifest vouches for it.

    Reads the files only (nothing is loaded): the library must exist, the manifest (:data:`MANIFEST_FILE`) must parse,
    record a successful subprocess probe, and match the library's size and sha256 and this process's build inputs
    (torch version, compiler, source, flags, platform).

    Args:
        folder: a build folder (:func:`onepass_build_dir`).
        inputs: the build inputs to match (default: this process's, which runs the compiler's ``--version``).

    Returns:
        ``None``, ``"missing"`` when there is no library, or a one-line reason naming what differs.
    """
    library = folder / f"{_NAME}.so"
    if not library.is_file():
        return "missing"
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"no readable {MANIFEST_FILE}"
    if not isinstance(manifest, dict) or manifest.get("probed") is not True:
        return f"{MANIFEST_FILE} records no successful load probe"
    size = library.stat().st_size
    if manifest.get("size") != size:
        return f"{size} bytes, the manifest says {manifest.get('size')!r} (truncated or replaced)"
    if manifest.get("sha256") != _sha256_file(library):
        return "its sha256 differs from the manifest's (damaged or replaced)"
    for key, value in (inputs if inputs is not None else _build_inputs()).items():
        if manifest.get(key) != value:
            return f"built with another {key} ({manifest.get(key)!r}, now {value!r})"
    return None


def _probe(library: Path) -> None:
    """Load ``library`` in a fresh Python process and check that it registers the op: a library that would crash a
    process on load (SIGBUS, SIGSEGV) or lacks the op is refused here, never loaded into this one.

    Raises:
        RuntimeError: naming the file, the exit status (a signal by name) and the probe's last error line.
    """
    code = ("import sys, torch; torch.ops.load_library(sys.argv[1]); "
            "sys.exit(0 if hasattr(torch.ops.sur_lab_onepass, 'attention') else 3)")
    run = subprocess.run([sys.executable, "-c", code, str(library)], capture_output=True, text=True, timeout=600)
    if run.returncode == 0:
        return
    rc = run.returncode
    status = "no sur_lab_onepass.attention op" if rc == 3 else f"exit {rc}"
    if rc < 0:
        try:
            status = f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            status = f"killed by signal {-rc}"
    lines = run.stderr.strip().splitlines()
    raise RuntimeError(f"{library} failed its load probe in a subprocess ({status}){': ' + lines[-1] if lines else ''}")


def _build(folder: Path, inputs: dict) -> Path:
    """Compile into a fresh folder, probe the library in a subprocess, write its manifest, then rename the folder into
    place (an old folder is moved aside first): a killed build leaves no half-built library behind, and no process
    ever sees a library without its manifest."""
    # import cost: cpp_extension (~0.2 s) is needed only to compile the kernel on first use
    from torch.utils import cpp_extension

    tmp = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()
    try:
        cpp_extension.load(
            name=_NAME,
            sources=[str(_SOURCE)],
            extra_cflags=_cflags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(tmp),
            is_python_module=False,
            verbose=False,
        )
        built = tmp / f"{_NAME}.so"
        _probe(built)
        manifest = {"library": built.name, "size": built.stat().st_size, "sha256": _sha256_file(built),
                    "probed": True, **inputs}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
        if folder.exists():
            stale = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}.stale")
            os.replace(folder, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder / f"{_NAME}.so"


def _library_path() -> Path:
    """The built library, verified against its manifest (:func:`verify_library`), compiling it first when this
    fingerprint has none and rebuilding it once when the cached one fails verification; under a file lock, so that
    concurrent test workers build once.

    Raises:
        RuntimeError: naming the cached file and what was wrong with it when its rebuild fails too; the build's own
            error when there was nothing cached.
    """
    inputs = _build_inputs()
    folder = _build_dir(inputs)
    library = folder / f"{_NAME}.so"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        problem = verify_library(folder, inputs)
        if problem is None:
            return library
        try:
            return _build(folder, inputs)
        except Exception as err:
            if problem == "missing":
                raise
            lines = str(err).strip().splitlines()
            raise RuntimeError(f"{library}: {problem}; its rebuild failed ({type(err).__name__}: "
                               f"{lines[-1] if lines else ''})") from err


def onepass_available() -> bool:
    """Whether the one-pass kernel runs in this process: builds or loads it on the first call, then remembers.

    Never raises and never loads an unverified file: any failure (no compiler, a failed build, a damaged cached
    library whose rebuild fails, a library that does not load or registers no op, ``SUR_LAB_NO_CPP_KERNEL=1``) gives
    False and one ``RuntimeWarning`` line naming the reason and, for a library, its file
    (:func:`onepass_unavailable_reason`) and the fallback. Thread-safe.
    """
    global _STATE, _REASON
    with _LOCK:
        if _STATE is None:
            try:
                if os.environ.get("SUR_LAB_NO_CPP_KERNEL", "") not in ("", "0"):
                    raise RuntimeError("disabled by SUR_LAB_NO_CPP_KERNEL")
                library = _library_path()
                if not hasattr(torch.ops.sur_lab_onepass, "attention"):
                    torch.ops.load_library(str(library))
                    if not hasattr(torch.ops.sur_lab_onepass, "attention"):
                        raise RuntimeError(f"{library} loaded but registers no sur_lab_onepass.attention op")
                _STATE = True
            except Exception as err:  # noqa: BLE001 - any build or load failure means: fall back, never fail
                _STATE = False
                lines = str(err).strip().splitlines()
                detail = f"{type(err).__name__}: {lines[-1] if lines else ''}"[:480]
                _REASON = detail
                warnings.warn(
                    f"sur_lab: the one-pass C++ attention kernel is unavailable ({detail}); packed attention falls "
                    "back to the key-split SDPA path",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return _STATE


def onepass_unavailable_reason() -> str:
    """Why :func:`onepass_available` returned False in this process ("" when it did not, or was not asked)."""
    return _REASON
