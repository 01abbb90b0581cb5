"""Indexed attention and indexed K/V writes (sur_lab.executors.kernels) against an explicit FP64 oracle (appendix 13.2, 13.5).

Without CUDA the Triton kernels run under Triton's interpreter: TRITON_INTERPRET=1 must be in the environment before
triton is first imported (its decorators read it), so it is set at the very top of this file; if an earlier module
imported triton without it, test_kernels_are_exercised_not_the_fallback fails and says so. BF16
under the interpreter goes through the kernel's FP32-conversion path (its bf16 ``tl.dot`` is wrong); the native bf16
dot is covered by the GPU-marked test only. The interpreter is slow: N stays <= 1023 and heads few.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton: its decorators (tl.max, tl.sum and our kernels alike) read it then.
    _TRITON_IMPORTED_EARLIER = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    os.environ["TRITON_INTERPRET"] = "1"
else:
    _TRITON_IMPORTED_EARLIER = False

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sur_lab.executors.kernels.reference import (  # noqa: E402
    causal_attention_oracle,
    indexed_scatter_kv_reference,
    kernel_error_floor,
    packed_sdpa_reference,
)

# import_module, not `import ... as`: the package re-exports the function indexed_attention, which shadows the
# submodule of the same name as a package attribute.
ia = importlib.import_module("sur_lab.executors.kernels.indexed_attention")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
requires_kernel = pytest.mark.skipif(
    not ia.uses_triton(DEVICE), reason="Triton not installed, or imported before TRITON_INTERPRET=1 was set"
)

# Fixed tolerances of appendix 13.5 against the FP64 oracle: (atol, rtol).
FIXED_TOLERANCES = {torch.bfloat16: (0.002, 0.02), torch.float16: (0.00025, 0.003)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _randn(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=DEVICE, dtype=dtype)


def _qkv(hq, hkv, b, n, d, dtype, seed=0):
    q = _randn((1, hq, b, d), dtype, seed)
    return q, _randn((1, hkv, n, d), dtype, seed + 1), _randn((1, hkv, n, d), dtype, seed + 2)


def _positions(values):
    return torch.as_tensor(sorted(set(values)), dtype=torch.int64, device=DEVICE)


def _sample(n, b, seed):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:b].tolist()


def _intervals(*spans):
    return _positions([p for lo, hi in spans for p in range(lo, hi)])


def assert_matches_oracle(out, q, k, v, positions, scale=None):
    """Kernel vs FP64 oracle: fixed tolerances for 16-bit inputs, and for every dtype an error within twice the
    same-dtype SDPA reference's own error plus ``kernel_error_floor`` (one output ulp and the FP32 exp2 budget of the
    online softmax; flash-attention style: 2x the same-dtype reference's error plus a floor)."""
    assert out.shape == q.shape and out.dtype == q.dtype
    oracle = causal_attention_oracle(q, k, v, positions, scale=scale)
    if q.dtype in FIXED_TOLERANCES:
        atol, rtol = FIXED_TOLERANCES[q.dtype]
        torch.testing.assert_close(out.double(), oracle, atol=atol, rtol=rtol)
    if out.numel() == 0:
        return
    sdpa = packed_sdpa_reference(q, k, v, positions, scale=scale)
    kernel_err = (out.double() - oracle).abs().max().item()
    sdpa_err = (sdpa.double() - oracle).abs().max().item()
    floor = kernel_error_floor(q, k, v, positions, scale=scale, oracle=oracle)
    assert kernel_err <= 2 * sdpa_err + floor, (kernel_err, sdpa_err, floor)


def test_kernels_are_exercised_not_the_fallback():
    # Guards the skip above: when another module imports triton first on a CPU-only machine, the kernel tests here
    # would silently test nothing but the PyTorch fallback.
    if not ia.HAS_TRITON:
        pytest.skip("Triton not installed")
    assert ia.uses_triton(DEVICE), (
        "triton was imported before TRITON_INTERPRET=1 was set"
        + (" (by an earlier test module)" if _TRITON_IMPORTED_EARLIER else "")
        + "; set it in the environment or at the top of tests/conftest.py when CUDA is absent"
    )


def test_kernel_error_floor_by_hand():
    # One visible key: the output is v_0 exactly, spread 0 -> floor = eps(dtype) * max|v| + eps32 * max|v| * 2.
    q = torch.ones(1, 1, 1, 64)
    k = torch.zeros(1, 1, 4, 64)
    v = torch.zeros(1, 1, 4, 64)
    v[0, 0, 0, :2] = torch.tensor([1.0, -3.0])
    eps = torch.finfo(torch.float32).eps
    assert kernel_error_floor(q, k, v, [0]) == pytest.approx(3 * eps + 3 * eps * 2, rel=1e-12)
    # Two visible keys with scores 0 and 8 * 0.125 = 1 (spread 1): |oracle| max = 3 / (1 + e) (weight of v_0).
    k[0, 0, 1, 0] = 8.0
    exp2_budget = eps * 3 * (2 + math.log2(math.e))
    assert kernel_error_floor(q, k, v, [1]) == pytest.approx(eps * 3 / (1 + math.e) + exp2_budget, rel=1e-6)
    half = torch.finfo(torch.float16).eps
    assert kernel_error_floor(q.half(), k.half(), v.half(), [1]) == pytest.approx(
        half * 3 / (1 + math.e) + exp2_budget, rel=1e-6
    )


# ---- plan (Eq. 23-24) --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "positions, n_full, n_total",
    [
        # tile 0: rows at 0..15 -> floor(1/64)=0, ceil(16/64)=1; tile 1: 63, 64, 200 -> floor(64/64)=1, ceil(201/64)=4
        (list(range(16)) + [63, 64, 200], [0, 1], [1, 4]),
        # tile 0: 100..115 -> floor(101/64)=1, ceil(116/64)=2; tile 1: 116..131 -> floor(117/64)=1, ceil(132/64)=3
        (list(range(100, 132)), [1, 1], [2, 3]),
        ([127], [2], [2]),  # row 127 sees exactly tiles 0 and 1, both complete: no masked tile at all
        ([128], [2], [3]),
        ([0], [0], [1]),
        ([], [], []),
    ],
)
def test_plan_tile_counts_by_hand(positions, n_full, n_total):
    plan = ia.build_indexed_attention_plan(torch.tensor(positions, dtype=torch.int64, device=DEVICE))
    assert plan.n_full.dtype == torch.int32 and plan.n_total.dtype == torch.int32
    assert plan.n_full.device == DEVICE and plan.positions.device == DEVICE
    assert plan.n_full.tolist() == n_full and plan.n_total.tolist() == n_total
    assert plan.num_rows == len(positions) and plan.num_tiles == len(n_full)
    assert plan.max_position == (positions[-1] if positions else -1)


def test_plan_custom_blocks_by_hand():
    plan = ia.build_indexed_attention_plan([3, 40], block_m=16, block_n=16)
    assert plan.n_full.tolist() == [0] and plan.n_total.tolist() == [3]  # floor(4/16), ceil(41/16)


def test_plan_is_linear_in_rows_not_cache_length():
    # A B x N bool mask here would take 4 GiB; the O(B) plan only reads the positions.
    u = 2**31 - 65  # the largest position the int32 tile arithmetic allows
    plan = ia.build_indexed_attention_plan([0, u])
    assert plan.n_full.tolist() == [0] and plan.n_total.tolist() == [math.ceil((u + 1) / 64)]
    with pytest.raises(ValueError, match="positions must be < 2\\*\\*31"):
        ia.build_indexed_attention_plan([0, u + 1])


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(0, 700), min_size=1, max_size=70), st.sampled_from([16, 32]), st.sampled_from([16, 64]))
def test_plan_matches_tile_visibility_definition(values, block_m, block_n):
    positions = sorted(values)
    plan = ia.build_indexed_attention_plan(positions, block_m=block_m, block_n=block_n)
    for t in range(plan.num_tiles):
        rows = positions[t * block_m : (t + 1) * block_m]
        # Brute force from the definition: a K/V tile is complete if every key in it is visible to every row of the
        # query tile, and visited if any key in it is visible to some row.
        tiles = range(max(rows) // block_n + 2)
        complete = [all(j <= u for u in rows for j in range(s * block_n, (s + 1) * block_n)) for s in tiles]
        visited = [any(s * block_n <= u for u in rows) for s in tiles]
        n_full = complete.index(False)
        assert all(not c for c in complete[n_full:])
        assert plan.n_full[t].item() == n_full
        assert plan.n_total[t].item() == sum(visited)


@pytest.mark.parametrize(
    "positions, match",
    [
        ([3, 1, 2], "sorted"),
        ([1, 1, 2], "sorted"),
        ([-1, 2], "non-negative"),
        ([[1, 2]], "1-D"),
        (torch.tensor([1.0, 2.0]), "integer"),
    ],
)
def test_plan_rejects_bad_positions(positions, match):
    with pytest.raises(ValueError, match=f"positions.*{match}"):
        ia.build_indexed_attention_plan(positions)


@pytest.mark.parametrize("kwargs", [{"block_m": 8}, {"block_n": 48}])
def test_plan_rejects_bad_blocks(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ia.build_indexed_attention_plan([1, 2], **kwargs)


# ---- references ---------------------------------------------------------------------------------------------------


def test_oracle_and_sdpa_reference_match_per_row_loop():
    q, k, v = _qkv(6, 2, 5, 37, 64, torch.float64, seed=3)
    positions = _positions([0, 4, 5, 20, 36])
    oracle = causal_attention_oracle(q, k, v, positions)
    expected = torch.empty_like(oracle)
    for h in range(6):
        for r, u in enumerate(positions.tolist()):
            kh, vh = k[0, h // 3, : u + 1], v[0, h // 3, : u + 1]  # repeat_kv: head h reads KV head h // 3
            expected[0, h, r] = torch.softmax(q[0, h, r] @ kh.T / 8.0, dim=-1) @ vh
    torch.testing.assert_close(oracle, expected, atol=1e-12, rtol=0)
    assert oracle.dtype == torch.float64
    torch.testing.assert_close(packed_sdpa_reference(q, k, v, positions), oracle, atol=1e-12, rtol=0)


# ---- indexed attention vs the FP64 oracle ------------------------------------------------------------------------

# (Hq, Hkv, D, N, positions): gaps, tails, single rows, all positions, GQA 1/3/4, head dims 64/128, awkward N.
ATTENTION_CASES = {
    "gaps_799_gqa3_d64": (9, 3, 64, 799, lambda: _intervals((5, 21), (100, 141), (400, 411), (700, 799))),
    "tail_113_gqa4_d128": (8, 2, 128, 113, lambda: _intervals((3, 9), (60, 91))),
    "random_1023_mha_d64": (2, 2, 64, 1023, lambda: _positions(_sample(1023, 45, seed=7))),
    "all_239_gqa3_d128": (3, 1, 128, 239, lambda: _positions(range(239))),
    "single_last_1023_d128": (4, 1, 128, 1023, lambda: _positions([1022])),
    "single_first_113_d64": (3, 3, 64, 113, lambda: _positions([0])),
}


@requires_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_indexed_attention_matches_oracle(case, dtype):
    hq, hkv, d, n, make_positions = ATTENTION_CASES[case]
    positions = make_positions()
    q, k, v = _qkv(hq, hkv, positions.numel(), n, d, dtype, seed=11)
    out = ia.indexed_attention(q, k, v, positions)
    assert_matches_oracle(out, q, k, v, positions)


@requires_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexed_attention_strided_inputs(dtype):
    hq, hkv, d, n = 4, 2, 64, 239
    positions = _intervals((0, 7), (64, 80), (150, 161), (230, 239))
    b = positions.numel()
    # q from the [1, B, Hq, D] projection layout viewed as [1, Hq, B, D], as attention modules do before SDPA.
    q = _randn((1, b, hq, d), dtype, 1).transpose(1, 2)
    # k from the same kind of transposed view; v a slice of a wider, longer buffer with an innermost stride of 2.
    k = _randn((1, n, hkv, d), dtype, 2).transpose(1, 2)
    v = _randn((1, hkv, n + 37, 2 * d), dtype, 3)[:, :, 5 : n + 5, ::2]
    assert not q.is_contiguous() and not k.is_contiguous() and v.stride(-1) == 2
    out = ia.indexed_attention(q, k, v, positions)
    assert out.is_contiguous()
    assert_matches_oracle(out, q, k, v, positions)


@requires_kernel
def test_indexed_attention_strided_positions():
    positions = _positions(range(239))[3::5]  # a non-contiguous view: the plan must not read it with unit stride
    assert not positions.is_contiguous()
    q, k, v = _qkv(2, 1, positions.numel(), 239, 64, torch.float32, seed=9)
    assert_matches_oracle(ia.indexed_attention(q, k, v, positions), q, k, v, positions)
    plan = ia.build_indexed_attention_plan(positions)
    assert plan.positions.is_contiguous() and plan.positions.data_ptr() != positions.data_ptr()


@requires_kernel
def test_indexed_attention_explicit_scale():
    positions = _intervals((10, 30), (90, 100))
    q, k, v = _qkv(2, 1, positions.numel(), 113, 64, torch.float16, seed=5)
    out = ia.indexed_attention(q, k, v, positions, scale=0.3)
    assert_matches_oracle(out, q, k, v, positions, scale=0.3)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_indexed_attention_reuses_plan_and_kernel_with_changed_metadata(dtype):
    hq, hkv, d, n = 4, 2, 64, 300
    plan_a = ia.build_indexed_attention_plan(_intervals((2, 30), (200, 210)))
    plan_b = ia.build_indexed_attention_plan(_intervals((0, 3), (63, 66), (127, 129), (250, 290)))
    assert plan_a.num_rows != plan_b.num_rows
    # One plan reused across two "layers", then new metadata through the same (already compiled) kernel, then back.
    for seed, plan in [(0, plan_a), (10, plan_a), (20, plan_b), (30, plan_a)]:
        q, k, v = _qkv(hq, hkv, plan.num_rows, n, d, dtype, seed=seed)
        out = ia.indexed_attention(q, k, v, plan)
        assert_matches_oracle(out, q, k, v, plan.positions)


@requires_kernel
@settings(max_examples=6, deadline=None)
@given(st.data())
def test_indexed_attention_random_supports(data):
    n = data.draw(st.integers(1, 200), label="N")
    positions = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=40), label="positions"))
    hkv, group = data.draw(st.sampled_from([(1, 1), (1, 3), (2, 4)]), label="heads")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    q, k, v = _qkv(hkv * group, hkv, len(positions), n, 64, dtype, seed=len(positions))
    out = ia.indexed_attention(q, k, v, _positions(positions))
    assert_matches_oracle(out, q, k, v, _positions(positions))


@requires_kernel
def test_indexed_attention_empty_selection():
    q, k, v = _qkv(2, 1, 0, 64, 64, torch.float16)
    out = ia.indexed_attention(q, k, v, _positions([]))
    assert out.shape == (1, 2, 0, 64) and out.dtype == torch.float16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["gaps_799_gqa3_d64", "tail_113_gqa4_d128", "all_239_gqa3_d128"])
def test_native_bf16_dot_on_gpu(case):
    # The compiled kernel's bf16 tl.dot path; under the interpreter bf16 goes through the FP32-conversion path.
    assert not ia.TRITON_INTERPRETED, "unset TRITON_INTERPRET to test the compiled bf16 path"
    hq, hkv, d, n, make_positions = ATTENTION_CASES[case]
    positions = make_positions()
    q, k, v = _qkv(hq, hkv, positions.numel(), n, d, torch.bfloat16, seed=13)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # a non-default stream, as in appendix 13.5
        out = ia.indexed_attention(q, k, v, positions)
    stream.synchronize()
    assert_matches_oracle(out, q, k, v, positions)


def test_cpu_fallback_without_interpreter_is_sdpa_reference(monkeypatch):
    monkeypatch.setattr(ia, "TRITON_INTERPRETED", False)
    assert not ia.uses_triton("cpu")
    positions = torch.tensor([1, 5, 90])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 64, generator=gen)
    k, v = torch.randn(2, 1, 2, 100, 64, generator=gen)
    torch.testing.assert_close(ia.indexed_attention(q, k, v, positions), packed_sdpa_reference(q, k, v, positions),
                               atol=0, rtol=0)  # fmt: skip


# ---- errors before any work ---------------------------------------------------------------------------------------


class _NoLaunch:
    """Stands in for a kernel: indexing it (the launch syntax) fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("kernel launched before validation failed")


@pytest.fixture
def no_work(monkeypatch):
    monkeypatch.setattr(ia, "_indexed_attn_fwd", _NoLaunch(), raising=False)
    monkeypatch.setattr(ia, "_indexed_scatter_kv_fwd", _NoLaunch(), raising=False)

    def _fail(*args, **kwargs):
        raise AssertionError("fallback ran before validation failed")

    monkeypatch.setattr(ia, "packed_sdpa_reference", _fail)
    monkeypatch.setattr(ia, "indexed_scatter_kv_reference", _fail)


def _attention_args(hq=4, hkv=2, b=3, n=100, d=64, dtype=torch.float16, positions=(1, 5, 90)):
    q, k, v = _qkv(hq, hkv, b, n, d, dtype)
    return q, k, v, torch.tensor(positions, device=DEVICE)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"positions": (5, 1, 90)}, "positions.*sorted"),
        ({"positions": (1, 5, 5)}, "positions.*sorted"),
        ({"positions": (1, 5, 100)}, "positions must be < N"),
        ({"d": 96}, "head_dim must be 64 or 128"),
        ({"dtype": torch.float64}, "q dtype"),
        ({"dtype": torch.int32}, "q dtype"),
        ({"hq": 3}, "multiple"),
        ({"b": 4}, "positions has 3"),
    ],
)
def test_indexed_attention_rejects_bad_inputs_before_launch(no_work, overrides, match):
    with pytest.raises(ValueError, match=match):
        ia.indexed_attention(*_attention_args(**overrides))


def test_indexed_attention_rejects_mismatched_dtypes_and_shapes(no_work):
    q, k, v, positions = _attention_args()
    with pytest.raises(ValueError, match="share a dtype"):
        ia.indexed_attention(q, k.float(), v, positions)
    with pytest.raises(ValueError, match="v must have the shape of k"):
        ia.indexed_attention(q, k, v[:, :, :50], positions)
    with pytest.raises(ValueError, match="batch size 1"):
        ia.indexed_attention(q.expand(2, -1, -1, -1), k, v, positions)


# ---- indexed scatter ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexed_scatter_kv_writes_exactly_the_selected_rows(dtype):
    hkv, n, d = 3, 113, 128
    positions = _intervals((0, 4), (50, 70), (110, 113))
    b = positions.numel()
    k_cache, v_cache = _randn((1, hkv, n, d), dtype, 0), _randn((1, hkv, n, d), dtype, 1)
    k_new = _randn((1, b, hkv, d), dtype, 2).transpose(1, 2)  # strided fresh rows, as a projection produces them
    v_new = _randn((1, hkv, b, d), dtype, 3)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    indexed_scatter_kv_reference(k_ref, v_ref, k_new, v_new, positions)
    k_before = k_cache.clone()
    ia.indexed_scatter_kv(k_cache, v_cache, k_new, v_new, ia.build_indexed_attention_plan(positions))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache[:, :, positions], k_new) and torch.equal(v_cache[:, :, positions], v_new)
    untouched = torch.ones(n, dtype=torch.bool, device=DEVICE)
    untouched[positions] = False
    assert torch.equal(k_cache[:, :, untouched], k_before[:, :, untouched])


@pytest.mark.parametrize(
    "positions, match",
    [((3, 1), "positions.*sorted"), ((1, 64), "positions must be < N"), ((1, 1), "positions.*sorted")],
)
def test_indexed_scatter_kv_rejects_bad_positions_without_writing(no_work, positions, match):
    k_cache, v_cache = _randn((1, 2, 64, 64), torch.float16, 0), _randn((1, 2, 64, 64), torch.float16, 1)
    k_new, v_new = _randn((1, 2, 2, 64), torch.float16, 2), _randn((1, 2, 2, 64), torch.float16, 3)
    before = k_cache.clone()
    with pytest.raises(ValueError, match=match):
        ia.indexed_scatter_kv(k_cache, v_cache, k_new, v_new, torch.tensor(positions, device=DEVICE))
    assert torch.equal(k_cache, before)


def test_indexed_scatter_kv_rejects_bad_shapes_and_dtypes(no_work):
    k_cache, v_cache = _randn((1, 2, 64, 96), torch.float16, 0), _randn((1, 2, 64, 96), torch.float16, 1)
    k_new, v_new = _randn((1, 2, 2, 96), torch.float16, 2), _randn((1, 2, 2, 96), torch.float16, 3)
    positions = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="k_cache head_dim"):
        ia.indexed_scatter_kv(k_cache, v_cache, k_new, v_new, positions)
    with pytest.raises(ValueError, match="k_new must have shape"):
        ia.indexed_scatter_kv(k_cache, v_cache, k_new[:, :1], v_new, positions)
    with pytest.raises(ValueError, match="v_new dtype"):
        ia.indexed_scatter_kv(k_cache, v_cache, k_new, v_new.float(), positions)
    with pytest.raises(ValueError, match="k_cache dtype"):
        ia.indexed_scatter_kv(*(t[..., :64].double() for t in (k_cache, v_cache, k_new, v_new)), positions)
