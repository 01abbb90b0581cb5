"""Packed executor, its attention backends and the execution controls (section 3.3, appendix 13.2-13.3).

Exactness: in float64 on tiny random Llama and Qwen3 models (float64 RoPE angles and RMSNorm) every executor equals
the interval-wise ``"sequential"`` reference to ~1e-15 (only reduction order differs); the tolerance is
``conftest.fp64_tol`` of the reference (64 ulp of its scale, ~6e-14), which a wrong mask, position or write order misses
by orders of magnitude. Rows that are not selected must be bitwise those
of the Shift cache, and the input cache bitwise unchanged.

The Triton backend runs here under Triton's interpreter (TRITON_INTERPRET=1 is set before anything imports triton,
as in test_kernels.py); the kernel takes float32 and head dim 64, so that test uses a float32 tiny model and the
float32 tolerance of the SDPA path's own error.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton (its decorators read it then); see test_kernels.py.
    os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import itertools  # noqa: E402

import hypothesis  # noqa: E402
import hypothesis.strategies as st  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import fp64_tol, make_tiny_model  # noqa: E402

from sur_lab.budget import Support  # noqa: E402
from sur_lab.cache_ops import caches_equal, clone_cache, slice_rows, to_tensors  # noqa: E402
from sur_lab.edits import token_edit  # noqa: E402
from sur_lab.executors import EXECUTORS, dirty, get_executor, shift  # noqa: E402
from sur_lab.models import UnsupportedModelError  # noqa: E402
from sur_lab.attention import native_implementation  # noqa: E402
from sur_lab.forward import prefill  # noqa: E402

import sur_lab.executors.packed as packed  # noqa: E402

EXACT_EXECUTORS = ["packed-sdpa", "packed-sdpa-split", "packed-flex-eager", "direct-sequential", "one-shot"]


def _setup(lm, n_original=72, prefix_len=9, deleted_len=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, lm.spec.vocab_size, (n_original,), generator=gen)
    edit = token_edit(ids, prefix_len, deleted_len, torch.randint(0, lm.spec.vocab_size, (4,), generator=gen))
    return edit, shift(lm, dirty(lm, edit), edit)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request):
    lm = make_tiny_model(request.param)
    edit, shift_cache = _setup(lm)
    return lm, edit, shift_cache


def _supports(suffix_len: int) -> dict[str, Support]:
    rng = np.random.default_rng(7)
    random_gaps = np.sort(rng.choice(suffix_len - 1, size=12, replace=False))
    return {
        "gaps_and_tail": Support(np.unique(np.r_[random_gaps, suffix_len - 3 : suffix_len]), suffix_len),
        "intervals": Support(np.r_[0:3, 10:14, 30:31, 40:47], suffix_len),
        "single_first": Support(np.array([0]), suffix_len),
        "single_last": Support(np.array([suffix_len - 1]), suffix_len),
        "all": Support.full(suffix_len),
    }


def _assert_matches_reference(out, ref, shift_cache, support, edit, atol):
    absolute = torch.as_tensor(support.absolute(edit.prefix_len))
    keep = torch.ones(shift_cache.layers[0].keys.shape[2], dtype=torch.bool)
    keep[absolute] = False
    for (k, v), (kr, vr), (ks, vs) in zip(to_tensors(out), to_tensors(ref), to_tensors(shift_cache)):
        assert k.shape == ks.shape and v.shape == vs.shape
        keep, absolute = keep.to(k.device), absolute.to(k.device)
        # Prefix and unselected rows: bitwise those of Shift.
        assert torch.equal(k[:, :, keep], ks[:, :, keep]) and torch.equal(v[:, :, keep], vs[:, :, keep])
        torch.testing.assert_close(k[:, :, absolute], kr[:, :, absolute], atol=atol, rtol=0)
        torch.testing.assert_close(v[:, :, absolute], vr[:, :, absolute], atol=atol, rtol=0)


@pytest.mark.parametrize("support_name", ["gaps_and_tail", "intervals", "single_first", "single_last", "all"])
def test_executors_equal_sequential_in_float64(case, support_name):
    lm, edit, shift_cache = case
    support = _supports(edit.suffix_len)[support_name]
    before = clone_cache(shift_cache)
    ref = get_executor("sequential")(lm, shift_cache, edit, support)
    # The reference must actually change the selected rows, or agreement would be vacuous.
    assert not caches_equal(ref, shift_cache)
    for name in EXACT_EXECUTORS:
        out = get_executor(name)(lm, shift_cache, edit, support)
        _assert_matches_reference(out, ref, shift_cache, support, edit, fp64_tol(ref))
        assert caches_equal(shift_cache, before), f"{name} modified its input cache"


def test_packed_accepts_plain_positions_and_empty_support(case):
    lm, edit, shift_cache = case
    support = _supports(edit.suffix_len)["intervals"]
    from_support = packed.refresh_packed(lm, shift_cache, edit, support)
    from_array = packed.refresh_packed(lm, shift_cache, edit, support.positions.tolist())
    assert caches_equal(from_support, from_array)
    empty = packed.refresh_packed(lm, shift_cache, edit, np.zeros(0, dtype=np.int64))
    assert caches_equal(empty, shift_cache)
    assert all(a.data_ptr() != b.data_ptr() for (a, _), (b, _) in zip(to_tensors(empty), to_tensors(shift_cache)))


def test_packed_differs_from_a_wrong_history(case):
    """Guard against a vacuous equality: attending only to the packed rows (no reused gaps) gives other K/V."""
    lm, edit, shift_cache = case
    support = _supports(edit.suffix_len)["gaps_and_tail"]
    out = packed.refresh_packed(lm, shift_cache, edit, support)
    # Zeroing the reused gap rows changes what selected rows attend to, hence their refreshed K/V.
    holed = clone_cache(shift_cache)
    keep = torch.ones(holed.layers[0].keys.shape[2], dtype=torch.bool)
    keep[torch.as_tensor(support.absolute(edit.prefix_len))] = False
    keep[: edit.prefix_len] = False
    for k, v in to_tensors(holed):
        k[:, :, keep] = 0
        v[:, :, keep] = 0
    wrong = packed.refresh_packed(lm, holed, edit, support)
    absolute = torch.as_tensor(support.absolute(edit.prefix_len))
    diff = max(
        (a[:, :, absolute] - b[:, :, absolute]).abs().max().item()
        for (a, _), (b, _) in zip(to_tensors(out), to_tensors(wrong))
    )
    assert diff > 1e-3


def test_exactly_one_output_clone(case, monkeypatch):
    lm, edit, shift_cache = case
    calls = []
    original = packed.clone_cache
    monkeypatch.setattr(packed, "clone_cache", lambda c: calls.append(1) or original(c))
    for backend in ("sdpa", "flex"):
        calls.clear()
        support = _supports(edit.suffix_len)["intervals"]
        packed.refresh_packed(lm, shift_cache, edit, support, backend=backend, flex_compile=False)
        assert len(calls) == 1


def test_ordinary_forwards_are_unchanged_after_a_failed_refresh(case, monkeypatch):
    lm, edit, shift_cache = case
    native = native_implementation(lm.model.config)
    _, before = prefill(lm, edit.edited_ids)

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(packed._PackedAttention, "attend", boom)
    with pytest.raises(RuntimeError, match="boom"):
        packed.refresh_packed(lm, shift_cache, edit, [0, 1])
    # Nothing was switched for the refresh, so nothing is left switched: same native function, same logits.
    assert native_implementation(lm.model.config) == native
    _, after = prefill(lm, edit.edited_ids)
    assert torch.equal(before, after)
    # The packed attention refuses to serve an ordinary forward.
    with pytest.raises(RuntimeError, match="packed refreshes only"):
        packed._packed_attention_forward(None, None, None, None, attention_mask=None)


@pytest.fixture
def no_work(case, monkeypatch):
    """Fails the test if an executor clones the cache or embeds a token."""
    lm, edit, shift_cache = case
    monkeypatch.setattr(packed, "clone_cache", lambda c: pytest.fail("cloned before validation"))
    handle = lm.model.model.embed_tokens.register_forward_pre_hook(lambda *a: pytest.fail("forward before validation"))
    yield lm, edit, shift_cache
    handle.remove()


@pytest.mark.parametrize(
    ("positions", "match"),
    [
        ([3, 1, 5], "sorted"),
        ([1, 3, 3], "sorted"),
        ([-1, 2], "suffix"),
        ("suffix_len", "suffix"),
        ([0.0, 1.0], "integers"),
        ([[0, 1]], "1-D"),
    ],
)
@pytest.mark.parametrize("name", ["packed-sdpa", "packed-flex", "direct-sequential", "one-shot"])
def test_bad_positions_raise_before_any_work(no_work, positions, match, name):
    lm, edit, shift_cache = no_work
    if positions == "suffix_len":
        positions = [0, edit.suffix_len]
    fn = {"packed-sdpa": packed.refresh_packed, "packed-flex": packed.refresh_packed,
          "direct-sequential": packed.refresh_direct_sequential, "one-shot": packed.refresh_one_shot}[name]
    with pytest.raises(ValueError, match=match):
        fn(lm, shift_cache, edit, positions)


def test_mismatched_support_and_cache_raise_before_any_work(no_work):
    lm, edit, shift_cache = no_work
    with pytest.raises(ValueError, match="suffix_len"):
        packed.refresh_packed(lm, shift_cache, edit, Support(np.array([0]), edit.suffix_len + 1))
    with pytest.raises(ValueError, match="rows"):
        packed.refresh_packed(lm, slice_rows(shift_cache, 0, 20), edit, [0])


def test_bad_backend_options_raise_before_any_work(no_work):
    lm, edit, shift_cache = no_work
    with pytest.raises(ValueError, match="backend="):
        packed.refresh_packed(lm, shift_cache, edit, [0], backend="xformers")
    with pytest.raises(ValueError, match="fused_scatter"):
        packed.refresh_packed(lm, shift_cache, edit, [0], fused_scatter=True)
    with pytest.raises(ValueError, match="sdpa_split"):
        packed.refresh_packed(lm, shift_cache, edit, [0], backend="flex", sdpa_split=True)
    # The tiny models are float64 with head dim 16: outside the kernel's FP16/BF16/FP32 and 64/128.
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        packed.refresh_packed(lm, shift_cache, edit, [0], backend="triton")


def test_unsupported_architectures_are_refused_before_any_work(no_work):
    lm, edit, shift_cache = no_work
    other = dataclasses.replace(lm, spec=dataclasses.replace(lm.spec, model_type="gpt_neox"))
    with pytest.raises(UnsupportedModelError, match="model_type"):
        packed.refresh_packed(other, shift_cache, edit, [0])
    layer = lm.model.model.layers[1]
    original_class = type(layer)
    layer.__class__ = type("CustomLayer", (original_class,), {"__module__": "somewhere.else"})
    try:
        with pytest.raises(UnsupportedModelError, match="native"):
            packed.refresh_one_shot(lm, shift_cache, edit, [0])
    finally:
        layer.__class__ = original_class
    layer.self_attn.forward = layer.self_attn.forward  # an instance-level patch
    try:
        with pytest.raises(UnsupportedModelError, match="patched"):
            packed.refresh_direct_sequential(lm, shift_cache, edit, [0])
    finally:
        del layer.self_attn.forward
    lm.model.train()
    try:
        with pytest.raises(UnsupportedModelError, match="training"):
            packed.refresh_packed(lm, shift_cache, edit, [0])
    finally:
        lm.model.eval()
    lm.model.config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    try:
        with pytest.raises(UnsupportedModelError, match="layer_types"):
            packed.refresh_packed(lm, shift_cache, edit, [0])
    finally:
        lm.model.config.layer_types = ["full_attention"] * 3


SPREAD = list(range(0, 16)) + list(range(400, 416)) + list(range(800, 816)) + list(range(1200, 1216))


def test_split_segments_hand_cases():
    seg = packed.KeySegment
    # Free calls: a boundary wherever the attending rows change and at each interval's first position (the gap before
    # an interval runs unmasked, its own keys masked; ties keep the longer segment); 64 packed rows never reach a
    # larger flash query block, so no call is padded.
    assert packed.split_segments(SPREAD, call_cost=0) == [
        seg(0, 0, 8, 0), seg(8, 8, 16, 8), seg(16, 16, 400, 16), seg(16, 400, 408, 16), seg(24, 408, 416, 24),
        seg(32, 416, 800, 32), seg(32, 800, 808, 32), seg(40, 808, 816, 40), seg(48, 816, 1200, 48),
        seg(48, 1200, 1208, 48), seg(56, 1208, 1216, 56),
    ]
    # Expensive calls or a compact support: one call.
    assert packed.split_segments(SPREAD, call_cost=10**9) == [seg(0, 0, 1216, 0)]
    assert packed.split_segments(np.arange(600, 664)) == [seg(0, 0, 664, 0)]
    # Default cost, GQA group 3 (192 folded rows, flash query blocks of 64): per key, 192 rows + 3 blocks x 32 =
    # 288; 96 rows + 3 x 32 = 192; 48 rows + 2 x 32 = 112; all three calls masked (x 1.12); so these 3 calls cost
    # 3 x 16384 + 1.12 x (416 x 288 + 400 x 192 + 400 x 112) = 319,528.96, less than one call's
    # 16384 + 1.12 x 1216 x 288 = 408,616.96 (the brute-force test below checks optimality).
    three = [seg(0, 0, 416, 0), seg(32, 416, 816, 32), seg(48, 816, 1216, 48)]
    assert packed.split_segments(SPREAD, group=3) == three
    assert packed.split_cost(SPREAD, three, group=3) == pytest.approx(319_528.96, rel=1e-12)
    assert packed.split_cost(SPREAD, [seg(0, 0, 1216, 0)], group=3) == pytest.approx(408_616.96, rel=1e-12)
    # Padding: 48 packed rows (144 folded, 5 blocks of 32: 144 + 160 = 304 per key) cost more than 64 (192 + 3
    # blocks of 64 x 32 = 288), so the gap keys 16..399 run with rows 0..63; with 100 rows, keys 40..999 (60 rows,
    # 180 folded: 372 per key) run as rows 36..99 (288 per key).
    assert seg(16, 16, 400, 0) in packed.split_segments(SPREAD, group=3, call_cost=0)
    assert seg(40, 40, 1000, 36) in packed.split_segments(list(range(40)) + list(range(1000, 1060)), group=3,
                                                           call_cost=0)
    # Long compact runs are cut near SPLIT_LONG_KEYS (CPU flash slows down past it).
    long = packed.split_segments(np.arange(4060, 4124), group=3)
    assert len(long) > 1 and all(s.key_end - s.key_start <= packed.SPLIT_LONG_KEYS for s in long)
    for bad in ([], [3, 3], [5, 2], [-1, 4]):
        with pytest.raises(ValueError, match="positions"):
            packed.split_segments(bad)
    with pytest.raises(ValueError, match="call_cost"):
        packed.split_segments([1], call_cost=-1)
    for name in ("granule", "group", "key_step"):
        with pytest.raises(ValueError, match=name):
            packed.split_segments([1], **{name: 0})
    for bad in ([], [seg(0, 0, 500, 0)], [seg(0, 0, 100, 0), seg(16, 200, 1216, 16)], [seg(0, 8, 1216, 0)]):
        with pytest.raises(ValueError, match="segments"):
            packed.split_cost(SPREAD, bad)
    with pytest.raises(ValueError, match="group"):
        packed.split_cost(SPREAD, three, group=0)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    positions=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12)), min_size=1, max_size=4).map(
        lambda runs: [s + i for s, n in zip(np.cumsum([g + 12 for g, _ in runs]) - 13, [n for _, n in runs])
                      for i in range(n)]
    ),
    call_cost=st.integers(0, 20_000),
    group=st.sampled_from([1, 3, 7]),
)
def test_split_segments_cover_keys_exactly_and_minimise_cost(positions, call_cost, group):
    u = np.asarray(positions)
    segments = packed.split_segments(u, group=group, call_cost=call_cost, granule=8, key_step=100)
    assert segments[0][:2] == (0, 0) and segments[-1].key_end == u[-1] + 1
    for s, t in zip(segments, segments[1:]):
        assert s.row <= t.row and s.key_end == t.key_start and s.key_start < s.key_end
    b = u.size
    for row, k0, _, call_row in segments:
        # Exactly the rows that see a key of the segment attend it; padding only moves the call's first row back, to
        # the cheapest call size (the rows themselves or a flash query-block threshold, in whole packed rows).
        assert (row == 0 or u[row - 1] < k0) and u[row] >= k0 and 0 <= call_row <= row
        sizes = [b - row] + [-(-m // group) for m, _, _ in packed.FLASH_Q_BLOCKS[:-1] if b - row < -(-m // group) <= b]
        cheapest = min(sizes, key=lambda n: (packed._per_key_cost(np.asarray(n * group)), n))
        assert b - call_row == cheapest
    # Optimal over every subset of the candidate boundaries (brute force).
    keys = packed._split_candidates(u, 8, 100)
    inner = keys[1:-1]
    hypothesis.assume(inner.size <= 11)

    def as_segments(cuts):
        edges = [0, *cuts, int(u[-1]) + 1]
        return [(int(np.searchsorted(u, k0)), k0, k1) for k0, k1 in zip(edges, edges[1:])]

    best = min(
        packed.split_cost(u, as_segments(chosen), group=group, call_cost=call_cost)
        for n in range(inner.size + 1) for chosen in itertools.combinations(inner.tolist(), n)
    )
    assert packed.split_cost(u, segments, group=group, call_cost=call_cost) == pytest.approx(best, rel=1e-12)


PADDED = list(range(40)) + list(range(1000, 1060))  # group 3, free calls: keys 40..999 run as rows 36..99


@pytest.mark.parametrize(
    "positions,group",
    [([0], 1), ([5], 7), ([0, 1, 2, 700, 701, 1500], 7), (list(range(3, 40)) + list(range(900, 950)), 7)],
    ids=["B=1 at 0", "B=1", "group 7 spread", "group 7, 87 rows"],
)
def test_split_attention_edge_cases_equal_single_masked_call(positions, group, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    u = torch.tensor(positions)
    kv_len = int(u[-1]) + 1
    q = torch.randn(1, 2 * group, u.numel(), 16, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, kv_len, 16, generator=gen, dtype=torch.float64)
    single = packed._make_attention("sdpa", u, kv_len, torch.float64, flex_compile=False)
    for cost in (0, packed.SPLIT_CALL_COST):
        monkeypatch.setattr(packed, "SPLIT_CALL_COST", cost)
        split = packed._make_attention(
            "sdpa", u, kv_len, torch.float64, flex_compile=False, sdpa_split=True, num_kv_groups=group
        )
        out = split.attend(q, k, v, 0.25)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, single.attend(q, k, v, 0.25), atol=fp64_tol(v), rtol=0)


@pytest.mark.parametrize("group", [1, 3])
def test_split_attention_equals_single_masked_call(group, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    positions = torch.tensor(SPREAD if group == 1 else PADDED)
    rows, kv_len = positions.numel(), int(positions[-1]) + 1
    q = torch.randn(1, 2 * group, rows, 16, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, kv_len, 16, generator=gen, dtype=torch.float64)
    single = packed._make_attention("sdpa", positions, kv_len, torch.float64, flex_compile=False)
    assert single.segments is None
    monkeypatch.setattr(packed, "SPLIT_CALL_COST", 0)
    split = packed._make_attention(
        "sdpa", positions, kv_len, torch.float64, flex_compile=False, sdpa_split=True, num_kv_groups=group
    )
    if group == 1:
        second, mask = split.segments[1]
        assert len(split.segments) == 11 and second == (8, 8, 16, 8) and mask.shape == (1, 1, 56, 8)
        assert split.segments[2] == ((16, 16, 400, 16), None)  # a gap every attending row sees whole: no mask
    else:  # a padded masked call: rows 36..39 run with keys they cannot see (mask 0), their outputs are dropped
        padded, mask = split.segments[6]
        assert padded == (40, 1000, 1008, 36) and mask.shape == (1, 1, 64 * 3, 8)
        assert torch.all(mask[0, 0, :12] == 0) and torch.isinf(mask[0, 0, 12:]).any()
    # FP64: FP64_ULPS of max|v| (the outputs are convex combinations of v rows; measured worst 1.5 ulp over 20 seeds
    # of every case here, against 64).
    torch.testing.assert_close(split.attend(q, k, v, 0.25), single.attend(q, k, v, 0.25), atol=fp64_tol(v), rtol=0)
    # FP32: the merge may not cost more than the single call's own error against FP64 (twice it, plus 1 ulp).
    q32, k32, v32 = q.float(), k.float(), v.float()
    split32 = packed._make_attention(
        "sdpa", positions, kv_len, torch.float32, flex_compile=False, sdpa_split=True, num_kv_groups=group
    )
    single32 = packed._make_attention("sdpa", positions, kv_len, torch.float32, flex_compile=False)
    oracle = single.attend(q32.double(), k32.double(), v32.double(), 0.25)
    err_split = (split32.attend(q32, k32, v32, 0.25).double() - oracle).abs().max().item()
    err_single = (single32.attend(q32, k32, v32, 0.25).double() - oracle).abs().max().item()
    assert err_split <= 2 * err_single + torch.finfo(torch.float32).eps


def test_split_executor_takes_the_split_path_and_equals_sequential(case, monkeypatch):
    lm, edit, shift_cache = case
    calls = []
    real = packed._split_sdpa
    monkeypatch.setattr(packed, "_split_sdpa", lambda *a: calls.append(len(a[3])) or real(*a))
    monkeypatch.setattr(packed, "SPLIT_CALL_COST", 0)
    for name in ("gaps_and_tail", "intervals", "all"):
        support = _supports(edit.suffix_len)[name]
        before = clone_cache(shift_cache)
        calls.clear()
        out = get_executor("packed-sdpa-split")(lm, shift_cache, edit, support)
        assert len(calls) == lm.spec.num_layers and min(calls) > 1  # every layer ran more than one segment
        ref = get_executor("sequential")(lm, shift_cache, edit, support)
        _assert_matches_reference(out, ref, shift_cache, support, edit, fp64_tol(ref))
        assert caches_equal(shift_cache, before)


def test_registered_executor_names():
    get_executor("sequential")  # triggers the optional import of sur_lab.executors.packed
    for name in ("packed", "packed-sdpa", "packed-sdpa-split", "packed-flex", "packed-flex-eager", "packed-cpp",
                 "packed-triton", "packed-triton-fused", "direct-sequential", "one-shot"):
        assert name in EXECUTORS


@pytest.mark.parametrize("rows", [[0], [5, 6, 7, 300], list(range(120, 260)), list(range(0, 700, 3))])
@pytest.mark.parametrize("kv_len", [701, 1024])
def test_flex_block_mask_equals_create_block_mask(rows, kv_len):
    from torch.nn.attention.flex_attention import create_block_mask

    positions = torch.tensor(rows)
    ours = packed.flex_block_mask(positions, kv_len)
    reference = create_block_mask(lambda b, h, q, kv: kv <= positions[q], None, None, len(rows), kv_len, device="cpu")
    assert torch.equal(ours.to_dense(), reference.to_dense())
    # The per-element mask inside partial blocks, materialized, is the causal mask of Eq. 22.
    dense = ours.mask_mod(0, 0, torch.arange(len(rows))[:, None], torch.arange(kv_len)[None, :])
    assert torch.equal(dense, packed.packed_causal_mask(positions, kv_len)[0, 0])


def test_triton_backend_matches_sdpa_under_the_interpreter():
    from sur_lab.executors.kernels import uses_triton

    if not uses_triton("cpu") and not torch.cuda.is_available():
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: the kernel path is not exercised")
    lm = make_tiny_model("qwen3", dtype=torch.float32, head_dim=64, hidden=64, layers=2)
    if torch.cuda.is_available():  # native kernels on a GPU; the interpreter on a CPU
        lm.model.to("cuda")
        lm = dataclasses.replace(lm, spec=dataclasses.replace(lm.spec, device="cuda"))
    edit, shift_cache = _setup(lm, n_original=150, prefix_len=7, deleted_len=4)
    support = Support(np.r_[0:5, 40:41, 70:90, edit.suffix_len - 2 : edit.suffix_len], edit.suffix_len)
    before = clone_cache(shift_cache)
    sdpa = packed.refresh_packed(lm, shift_cache, edit, support)
    ref = get_executor("sequential")(lm, shift_cache, edit, support)
    # Tolerance from the SDPA path's own float32 error against the reference, with a floor of a few ulps.
    sdpa_err = max((a - b).abs().max().item() for (a, _), (b, _) in zip(to_tensors(sdpa), to_tensors(ref)))
    atol = 4 * sdpa_err + 1e-5
    for fused in (False, True):
        out = packed.refresh_packed(lm, shift_cache, edit, support, backend="triton", fused_scatter=fused)
        _assert_matches_reference(out, ref, shift_cache, support, edit, atol)
    assert caches_equal(shift_cache, before)


@pytest.mark.slow
def test_compiled_flex_matches_sdpa():
    """The registered packed-flex compiles flex_attention (12-100 s on 2 CPU cores, cached by inductor afterwards)."""
    lm = make_tiny_model("llama", dtype=torch.float32)
    edit, shift_cache = _setup(lm)
    support = _supports(edit.suffix_len)["gaps_and_tail"]
    ref = get_executor("sequential")(lm, shift_cache, edit, support)
    sdpa = get_executor("packed-sdpa")(lm, shift_cache, edit, support)
    sdpa_err = max((a - b).abs().max().item() for (a, _), (b, _) in zip(to_tensors(sdpa), to_tensors(ref)))
    out = get_executor("packed-flex")(lm, shift_cache, edit, support)
    _assert_matches_reference(out, ref, shift_cache, support, edit, 4 * sdpa_err + 1e-5)


@pytest.mark.slow
def test_packed_on_the_embedded_model(smol):
    from sur_lab.studies.bench import matched_support, synthetic_edit

    edit = synthetic_edit(smol.spec.vocab_size, 300, seed=3)
    shift_cache = shift(smol, dirty(smol, edit), edit)
    support = matched_support(300, edit.prefix_len, 16, 4)
    ref = get_executor("sequential")(smol, shift_cache, edit, support)
    sdpa = get_executor("packed-sdpa")(smol, shift_cache, edit, support)
    # float32 through 30 layers: the sequential path itself differs from Re-prefill-style recomputation by ~1e-5.
    _assert_matches_reference(sdpa, ref, shift_cache, support, edit, 1e-3)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-p", "no:xdist", "-q"]))
