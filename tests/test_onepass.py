"""The one-pass C++ CPU attention kernel (sur_lab.executors.kernels.onepass) and the ``packed-cpp`` executor.

The kernel is compiled on first use into the model cache folder (about 10 s on 2 cores, once per machine and source;
later processes load the built library), so the compiled path is what these tests exercise, in CI too: a machine
without a compiler fails ``test_the_kernel_is_built_here`` instead of skipping silently. Tolerances are the Triton
kernel's (tests/test_kernels.py): against the FP64 oracle, the fixed BF16/FP16 tolerances of appendix 13.5 and, for
every dtype, at most twice the same-dtype SDPA reference's own error plus ``kernel_error_floor``; float64 at
``conftest.fp64_tol``. The fallback (a failed build) is tested with an invalid compiler and a fresh cache folder.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see test_kernels.py)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import fp64_tol, make_tiny_model  # noqa: E402
from test_packed import _setup  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sur_lab.budget import Support  # noqa: E402
from sur_lab.cache_ops import caches_equal, clone_cache, to_tensors  # noqa: E402
from sur_lab.executors import get_executor, replay  # noqa: E402
from sur_lab.executors.kernels import onepass  # noqa: E402
from sur_lab.executors.kernels.reference import (  # noqa: E402
    causal_attention_oracle,
    kernel_error_floor,
    packed_sdpa_reference,
)

import sur_lab.executors.packed as packed  # noqa: E402

FIXED_TOLERANCES = {torch.bfloat16: (0.002, 0.02), torch.float16: (0.00025, 0.003)}  # appendix 13.5, as Triton's
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _qkv(hq, hkv, b, n, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for shape in ((1, hq, b, d), (1, hkv, n, d), (1, hkv, n, d)))
    return q, k, v


def assert_matches_oracle(out, q, k, v, positions, scale=None):
    """As tests/test_kernels.py: fixed 16-bit tolerances, and within 2x the same-dtype SDPA error + the floor."""
    assert out.shape == q.shape and out.dtype == q.dtype
    oracle = causal_attention_oracle(q, k, v, positions, scale=scale)
    if q.dtype == torch.float64:
        torch.testing.assert_close(out, oracle, atol=fp64_tol(v), rtol=0)
        return
    if q.dtype in FIXED_TOLERANCES:
        atol, rtol = FIXED_TOLERANCES[q.dtype]
        torch.testing.assert_close(out.double(), oracle, atol=atol, rtol=rtol)
    err = (out.double() - oracle).abs().max().item()
    sdpa_err = (packed_sdpa_reference(q, k, v, positions, scale=scale).double() - oracle).abs().max().item()
    assert err <= 2 * sdpa_err + kernel_error_floor(q, k, v, positions, scale=scale, oracle=oracle), (err, sdpa_err)


def _intervals(*spans):
    return [p for lo, hi in spans for p in range(lo, hi)]


def test_the_kernel_is_built_here():
    # CI machines have a C++ compiler and the Python headers: the compiled path must run there, not only the fallback.
    assert onepass.onepass_available(), onepass.onepass_unavailable_reason()
    folder = onepass.onepass_build_dir()
    assert folder.parent.parent == __import__("sur_lab.models", fromlist=["cache_root"]).cache_root()
    assert (folder / "sur_lab_onepass.so").is_file()


# ---- plan (Eq. 23-24 at row granularity) ---------------------------------------------------------------------------


def test_plan_by_hand():
    # Rows at 3, 70, 71, 200; 64-key tiles 0..3 (keys up to 200). Tile 0 is visited by all 4 rows (u >= 0) and row 3
    # ends in it; tile 1 (64..127) by rows 70, 71, 200, two of which end in it; tiles 2 and 3 by row 200 only.
    plan = onepass.build_onepass_plan([3, 70, 71, 200], block_n=64)
    assert plan.bounds.tolist() == [0, 64, 128, 201] and plan.num_tiles == 3 and plan.max_position == 200
    # A score budget of 2 tiles for one row: tiles 2 and 3 stay merged; for 4 rows (group 2 x 2 rows) they split.
    assert onepass.build_onepass_plan([3, 70, 71, 200], block_n=64, tile_scores=128).bounds.tolist() == [
        0, 64, 128, 201]
    assert onepass.build_onepass_plan([3, 70, 71, 200], block_n=64, tile_scores=64).bounds.tolist() == [
        0, 64, 128, 192, 201]
    assert onepass.build_onepass_plan([0], block_n=64).bounds.tolist() == [0, 1]
    # Rows that never change over 300 keys: one merged tile up to max_tile_keys.
    assert onepass.build_onepass_plan([299], block_n=64, max_tile_keys=128).bounds.tolist() == [0, 128, 256, 300]
    empty = onepass.build_onepass_plan([])
    assert empty.num_rows == 0 and empty.num_tiles == 0 and empty.max_position == -1


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(0, 900), min_size=1, max_size=60), st.sampled_from([1, 3, 7]), st.sampled_from([16, 64]),
       st.sampled_from([64, 4096, 1 << 17]))
def test_plan_tiles_follow_the_row_ends(values, group, block_n, tile_scores):
    u = np.array(sorted(values))
    plan = onepass.build_onepass_plan(u, group=group, block_n=block_n, tile_scores=tile_scores)
    bounds = plan.bounds.numpy()
    assert bounds[0] == 0 and bounds[-1] == u[-1] + 1 and np.all(np.diff(bounds) > 0)
    assert np.all(bounds[1:-1] % block_n == 0)
    for k0, k1 in zip(bounds[:-1], bounds[1:]):
        # Rows end (u_r falls) only in the last block_n keys of a merged tile: no row computes more than
        # block_n - 1 masked keys past its causal limit.
        ends = u[(u >= k0) & (u < k1 - 1)]
        assert np.all(ends >= k1 - block_n)
        rows = int(np.sum(u >= k0)) * group
        assert k1 - k0 <= block_n or rows * (k1 - k0) <= tile_scores  # the score budget, past the first tile


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(group=0), "group"), (dict(block_n=0), "block_n"), (dict(tile_scores=0), "tile_scores"),
    (dict(block_n=64, max_tile_keys=32), "max_tile_keys"),
])
def test_plan_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        onepass.build_onepass_plan([1, 2], **kwargs)


@pytest.mark.parametrize(("positions", "match"), [([3, 1], "sorted"), ([-1, 2], "non-negative"), ([[1]], "1-D")])
def test_plan_rejects_bad_positions(positions, match):
    with pytest.raises(ValueError, match=f"positions.*{match}"):
        onepass.build_onepass_plan(positions)


# ---- kernel vs the FP64 oracle -------------------------------------------------------------------------------------

# (Hq, Hkv, D, N, positions): gaps, tails, B = 1 at 0 and at the end, every position, GQA groups 1 / 3 / 7, head dims
# 16 / 64 / 128, awkward N (tile and vector tails).
CASES = {
    "gaps_799_gqa3_d64": (9, 3, 64, 799, _intervals((5, 21), (100, 141), (400, 411), (700, 799))),
    "tail_113_gqa7_d128": (14, 2, 128, 113, _intervals((3, 9), (60, 91))),
    "random_1023_mha_d64": (2, 2, 64, 1023, sorted(np.random.default_rng(7).choice(1023, 45, replace=False))),
    "all_239_gqa3_d16": (3, 1, 16, 239, list(range(239))),
    "single_first_113_gqa7": (7, 1, 64, 113, [0]),
    "single_last_1023_d128": (4, 1, 128, 1023, [1022]),
    "spread_5000_gqa3": (6, 2, 64, 5000, _intervals((0, 3), (1700, 1710), (4990, 5000))),
}


@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_oracle(case, dtype):
    hq, hkv, d, n, positions = CASES[case]
    q, k, v = _qkv(hq, hkv, len(positions), n, d, dtype, seed=11)
    out = onepass.onepass_attention(q, k, v, positions)
    assert out.transpose(1, 2).is_contiguous()  # [1, B, Hq, D] storage, the layout attention modules return
    assert_matches_oracle(out, q, k, v, positions)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_kernel_row_chunks_and_small_tiles(dtype, monkeypatch):
    # Many chunks (4 folded rows each, with a remainder) and 16-key tiles: each chunk reads the tiles its rows see.
    monkeypatch.setattr(onepass, "ONEPASS_CHUNK_ROWS", 4)
    positions = _intervals((0, 5), (40, 47), (300, 301), (600, 640))
    q, k, v = _qkv(6, 2, len(positions), 700, 64, dtype, seed=3)
    plan = onepass.build_onepass_plan(positions, group=3, block_n=16, tile_scores=64)
    assert plan.num_tiles > 20
    assert_matches_oracle(onepass.onepass_attention(q, k, v, plan), q, k, v, positions)


@pytest.mark.parametrize("hkv", [2, 3])
def test_kernel_with_two_threads(hkv):
    # Several threads: (KV head, row chunk) items are spread over them; each row's result is still its own.
    positions = _intervals((2, 9), (100, 130), (500, 511))
    q, k, v = _qkv(3 * hkv, hkv, len(positions), 600, 64, torch.float32, seed=4)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = onepass.onepass_attention(q, k, v, positions)
    finally:
        torch.set_num_threads(before)
    assert_matches_oracle(out, q, k, v, positions)


def test_kernel_strided_inputs_and_scale():
    positions = _intervals((0, 7), (64, 80), (150, 161), (230, 239))
    b = len(positions)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, b, 4, 64, generator=gen).transpose(1, 2)  # the projection layout viewed as [1, Hq, B, D]
    k = torch.randn(1, 239, 2, 64, generator=gen).transpose(1, 2)
    v = torch.randn(1, 2, 276, 128, generator=gen)[:, :, 5:244, ::2]  # innermost stride 2
    assert not q.is_contiguous() and v.stride(-1) == 2
    assert_matches_oracle(onepass.onepass_attention(q, k, v, positions, scale=0.3), q, k, v, positions, scale=0.3)


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_kernel_random_supports(data):
    n = data.draw(st.integers(1, 400), label="N")
    positions = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=50), label="positions"))
    hkv, group = data.draw(st.sampled_from([(1, 1), (1, 3), (2, 7)]), label="heads")
    dtype = data.draw(st.sampled_from([torch.float64, *DTYPES]), label="dtype")
    block_n = data.draw(st.sampled_from([16, 64]), label="block_n")
    q, k, v = _qkv(hkv * group, hkv, len(positions), n, 64, dtype, seed=len(positions))
    plan = onepass.build_onepass_plan(positions, group=group, block_n=block_n)
    assert_matches_oracle(onepass.onepass_attention(q, k, v, plan), q, k, v, positions)


def test_kernel_empty_selection_and_bad_inputs():
    q, k, v = _qkv(2, 1, 0, 64, 64, torch.float32)
    assert onepass.onepass_attention(q, k, v, []).shape == (1, 2, 0, 64)
    q, k, v = _qkv(2, 1, 2, 64, 64, torch.float32)
    with pytest.raises(ValueError, match="positions must be < N"):
        onepass.onepass_attention(q, k, v, [3, 64])
    with pytest.raises(ValueError, match="positions"):
        onepass.onepass_attention(q, k, v, [3])
    with pytest.raises(ValueError, match="dtype"):
        onepass.onepass_attention(*(t.to(torch.int32) for t in (q, k, v)), [1, 2])
    with pytest.raises(ValueError, match="k heads"):
        onepass.onepass_attention(q, torch.zeros(1, 3, 64, 64), torch.zeros(1, 3, 64, 64), [1, 2])


# ---- fallback -----------------------------------------------------------------------------------------------------


def _reset(monkeypatch):
    monkeypatch.setattr(onepass, "_STATE", None)
    monkeypatch.setattr(onepass, "_REASON", "")


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, tmp_path):
    # A fresh cache folder (nothing built) and a compiler that does not exist: no library, no exception.
    _reset(monkeypatch)
    monkeypatch.setenv("SUR_LAB_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="one-pass C\\+\\+ attention kernel is unavailable.*key-split") as record:
        assert not onepass.onepass_available()
        assert not onepass.onepass_available()  # remembered: no second attempt, no second warning
    assert len(record) == 1 and "\n" not in str(record[0].message)
    assert "no-such-compiler" in onepass.onepass_unavailable_reason()
    # The kernel wrapper falls back to the SDPA reference, the executor to the key split: same results as those.
    positions = _intervals((0, 4), (30, 40))
    q, k, v = _qkv(6, 2, len(positions), 50, 16, torch.float64)
    torch.testing.assert_close(onepass.onepass_attention(q, k, v, positions),
                               packed_sdpa_reference(q, k, v, positions), atol=0, rtol=0)
    attention = packed._make_attention("cpp", torch.tensor(positions), 40, torch.float64, flex_compile=False,
                                       num_kv_groups=3)
    assert attention.backend == "sdpa" and attention.segments is not None


def test_a_failing_loader_falls_back(monkeypatch):
    _reset(monkeypatch)

    def broken():
        raise OSError("undefined symbol: sgemm_")

    monkeypatch.setattr(onepass, "_library_path", broken)
    with pytest.warns(RuntimeWarning, match="undefined symbol"):
        assert not onepass.onepass_available()
    lm = make_tiny_model("llama")
    edit, shift_cache = _setup(lm)
    support = Support(np.r_[0:3, 20:26, 50:55], edit.suffix_len)
    out = get_executor("packed-cpp")(lm, shift_cache, edit, support)
    assert caches_equal(out, get_executor("packed-sdpa-split")(lm, shift_cache, edit, support))


def test_disabled_by_environment(monkeypatch):
    _reset(monkeypatch)
    monkeypatch.setenv("SUR_LAB_NO_CPP_KERNEL", "1")
    with pytest.warns(RuntimeWarning, match="SUR_LAB_NO_CPP_KERNEL"):
        assert not onepass.onepass_available()


# ---- integrity of the cached library (issue 38) --------------------------------------------------------------------
# Each check runs in a fresh Python process over a copy of the built kernel folder in a temporary cache: a damaged
# library loaded by dlopen kills its process (a truncated one with SIGBUS, exit 135), so the process that meets it
# must be another one, and its exit status says whether it survived. "The compiler" is, unless a test says otherwise,
# a copy of the good build into the build folder (the rebuild path without its ~10-60 s of compiling; the real
# compile is the slow test below).

_PROBE = """
import json, os, shutil, sys, warnings
import torch
from torch.utils import cpp_extension

compiler, good = sys.argv[1], sys.argv[2]


def fake_load(name, sources, build_directory, **kwargs):
    if compiler == "broken":
        raise RuntimeError("Error building extension 'sur_lab_onepass': c++: fatal error")
    shutil.copy(good, os.path.join(build_directory, name + ".so"))


if compiler != "real":
    cpp_extension.load = fake_load
from sur_lab.executors.kernels import onepass
from sur_lab.executors.kernels.reference import packed_sdpa_reference
import sur_lab.executors.packed as packed

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    available = onepass.onepass_available()
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 16, generator=gen), torch.randn(1, 2, 40, 16, generator=gen), torch.randn(
        1, 2, 40, 16, generator=gen)
    out = onepass.onepass_attention(q, k, v, [5, 20, 39])  # the kernel, or the fallback: never an AttributeError
    attention = packed._make_attention("cpp", torch.tensor([5, 20, 39]), 0, torch.float32, flex_compile=False,
                                       num_kv_groups=2)
print(json.dumps({
    "available": available, "reason": onepass.onepass_unavailable_reason(),
    "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    "close": bool(torch.allclose(out, packed_sdpa_reference(q, k, v, torch.tensor([5, 20, 39])), atol=1e-5)),
    "backend": attention.backend, "problem": onepass.verify_library(onepass.onepass_build_dir()),
}))
"""


@pytest.fixture
def kernel_copy(tmp_path):
    """``(cache root, build folder, good library)``: the built kernel's folder copied into a temporary cache."""
    import shutil

    good = onepass._library_path()  # built (or verified) in the real cache, once per machine
    cache = tmp_path / "cache"
    folder = cache / "kernels" / good.parent.name
    shutil.copytree(good.parent, folder)
    spare = tmp_path / "good.so"
    shutil.copy(good, spare)
    return cache, folder, spare


def _probe_process(cache, good, compiler="copy"):
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "SUR_LAB_CACHE": str(cache), "PYTHONPATH": str(repo)}
    env.pop("SUR_LAB_NO_CPP_KERNEL", None)
    run = subprocess.run([sys.executable, "-c", _PROBE, compiler, str(good)], capture_output=True, text=True, env=env,
                         timeout=900)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # 135 would be SIGBUS: the crash of issue 38
    return json.loads(run.stdout.strip().splitlines()[-1])


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _sha(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_truncated_cached_library_is_rebuilt_in_a_later_process(kernel_copy):
    cache, folder, good = kernel_copy
    library = folder / "sur_lab_onepass.so"
    _truncate(library)
    assert "truncated or replaced" in onepass.verify_library(folder)
    result = _probe_process(cache, good)
    assert result["available"] and result["warnings"] == [] and result["close"] and result["backend"] == "cpp"
    assert result["problem"] is None and _sha(library) == _sha(good)  # rebuilt once, atomically, with its manifest
    again = _probe_process(cache, good, compiler="broken")  # a later process loads the rebuilt library: no build
    assert again["available"] and again["warnings"] == []


def test_another_library_in_its_place_is_rebuilt(kernel_copy):
    import shutil

    cache, folder, good = kernel_copy
    library = folder / "sur_lab_onepass.so"
    shutil.copy(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_global_deps.so"), library)
    assert "sha256 differs" in onepass.verify_library(folder) or "bytes" in onepass.verify_library(folder)
    result = _probe_process(cache, good)
    assert result["available"] and result["close"] and result["backend"] == "cpp" and _sha(library) == _sha(good)


@pytest.mark.parametrize("damage", ["truncated", "manifest deleted", "manifest of another torch"])
def test_a_damaged_library_whose_rebuild_fails_falls_back_with_one_warning_naming_the_file(kernel_copy, damage):
    import json

    cache, folder, good = kernel_copy
    library = folder / "sur_lab_onepass.so"
    if damage == "truncated":
        _truncate(library)
    elif damage == "manifest deleted":
        (folder / onepass.MANIFEST_FILE).unlink()
    else:
        manifest = json.loads((folder / onepass.MANIFEST_FILE).read_text())
        (folder / onepass.MANIFEST_FILE).write_text(json.dumps({**manifest, "torch": "1.0.0"}))
    for _ in range(2 if damage == "truncated" else 1):  # and a later process: the damaged file stays, crashes none
        result = _probe_process(cache, good, compiler="broken")
        assert not result["available"] and result["close"] and result["backend"] == "sdpa"
        assert len(result["warnings"]) == 1 and "\n" not in result["warnings"][0]
        assert f"{library}: " in result["warnings"][0] and "its rebuild failed" in result["warnings"][0]
        assert "falls back to the key-split SDPA path" in result["warnings"][0]
        assert result["problem"] is not None


def test_a_loaded_library_without_the_op_falls_back_with_one_warning(kernel_copy):
    """A manifest that vouches for a library which registers no op (both replaced): after loading, the missing op is
    caught, named with the file, and the packed refresh falls back, with no AttributeError."""
    import hashlib
    import json
    import shutil

    cache, folder, good = kernel_copy
    library = folder / "sur_lab_onepass.so"
    shutil.copy(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_global_deps.so"), library)
    manifest = json.loads((folder / onepass.MANIFEST_FILE).read_text())
    manifest.update(size=library.stat().st_size, sha256=hashlib.sha256(library.read_bytes()).hexdigest())
    (folder / onepass.MANIFEST_FILE).write_text(json.dumps(manifest))
    assert onepass.verify_library(folder) is None
    result = _probe_process(cache, good, compiler="broken")
    assert not result["available"] and result["close"] and result["backend"] == "sdpa"
    assert result["warnings"] == [result["warnings"][0]]
    assert f"{library} loaded but registers no sur_lab_onepass.attention op" in result["warnings"][0]


@pytest.mark.slow
def test_a_truncated_cached_library_is_rebuilt_by_the_compiler(kernel_copy):
    cache, folder, good = kernel_copy
    _truncate(folder / "sur_lab_onepass.so")
    result = _probe_process(cache, good, compiler="real")
    assert result["available"] and result["warnings"] == [] and result["close"] and result["problem"] is None


# ---- the packed-cpp executor -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "heads", "kv_heads"), [("llama", 4, 2), ("qwen3", 4, 2), ("llama", 4, 4),
                                                          ("qwen3", 6, 2), ("llama", 7, 1)],
                         ids=["llama-g2", "qwen3-g2", "llama-g1", "qwen3-g3", "llama-g7"])
def test_packed_cpp_equals_sequential_in_float64_on_random_supports(kind, heads, kv_heads, monkeypatch):
    # Small tiles so that the tiny model's ~70 keys span several tiles and row ends fall inside them.
    monkeypatch.setattr(onepass, "ONEPASS_BLOCK_N", 16)
    lm = make_tiny_model(kind, heads=heads, kv_heads=kv_heads, hidden=8 * heads)  # hidden: a multiple of the heads
    edit, shift_cache = _setup(lm)
    before = clone_cache(shift_cache)
    calls = []
    real = onepass._attend
    monkeypatch.setattr(onepass, "_attend", lambda *a: calls.append(a[3].num_tiles) or real(*a))
    rng = np.random.default_rng(3)
    s = edit.suffix_len
    supports = [Support(np.sort(rng.choice(s, size=size, replace=False)), s) for size in (1, 7, 25)]
    supports += [Support(np.array([0]), s), Support(np.array([s - 1]), s), Support.full(s)]
    for support in supports:
        calls.clear()
        ref = get_executor("sequential")(lm, shift_cache, edit, support)
        out = get_executor("packed-cpp")(lm, shift_cache, edit, support)
        assert len(calls) == lm.spec.num_layers  # the kernel ran in every layer (not the fallback)
        absolute = torch.as_tensor(support.absolute(edit.prefix_len))
        keep = torch.ones(shift_cache.layers[0].keys.shape[2], dtype=torch.bool)
        keep[absolute] = False
        for (k, v), (kr, vr), (ks, vs) in zip(to_tensors(out), to_tensors(ref), to_tensors(shift_cache)):
            assert torch.equal(k[:, :, keep], ks[:, :, keep]) and torch.equal(v[:, :, keep], vs[:, :, keep])
            torch.testing.assert_close(k[:, :, absolute], kr[:, :, absolute], atol=fp64_tol(ref), rtol=0)
            torch.testing.assert_close(v[:, :, absolute], vr[:, :, absolute], atol=fp64_tol(ref), rtol=0)
        assert caches_equal(shift_cache, before)


@pytest.mark.parametrize("name", ["packed", "packed-cpp", "packed-sdpa-split"])
def test_packed_at_a_full_support_equals_replay(name):
    """A 100 % support is an exact Replay on the packed path: the honest Replay baseline of the benchmark."""
    lm = make_tiny_model("qwen3")
    edit, shift_cache = _setup(lm)
    ref = replay(lm, shift_cache, edit)
    out = get_executor(name)(lm, shift_cache, edit, Support.full(edit.suffix_len))
    for (k, v), (kr, vr) in zip(to_tensors(out), to_tensors(ref)):
        torch.testing.assert_close(k, kr, atol=fp64_tol(ref), rtol=0)
        torch.testing.assert_close(v, vr, atol=fp64_tol(ref), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_cpp_low_precision_within_the_sdpa_paths_error(dtype):
    # As the Triton backend's check (test_packed.py): against the same-dtype sequential executor, within 4x the
    # packed SDPA path's own error plus a few ulps.
    lm = make_tiny_model("llama", dtype=dtype, head_dim=64, hidden=64, layers=2)
    edit, shift_cache = _setup(lm, n_original=150, prefix_len=7, deleted_len=4)
    support = Support(np.r_[0:5, 40:41, 70:90, edit.suffix_len - 2 : edit.suffix_len], edit.suffix_len)
    ref = get_executor("sequential")(lm, shift_cache, edit, support)
    absolute = torch.as_tensor(support.absolute(edit.prefix_len))

    def error(cache):
        return max((a[:, :, absolute].double() - b[:, :, absolute].double()).abs().max().item()
                   for (a, _), (b, _) in zip(to_tensors(cache), to_tensors(ref)))

    sdpa_err = error(get_executor("packed-sdpa")(lm, shift_cache, edit, support))
    cpp_err = error(get_executor("packed-cpp")(lm, shift_cache, edit, support))
    assert sdpa_err > 0  # the reference differs by reduction order: the bound is not vacuous
    assert cpp_err <= 4 * sdpa_err + 8 * torch.finfo(dtype).eps, (cpp_err, sdpa_err)
