"""In-place refresh and Shift for caches the caller gives up, and the preparation overlap (issue 17, appendix 13.3).

In-place forms run the same arithmetic on the same values as the cloning path (only the destination of the writes
differs), and the overlapped recovery runs the same functions on the same inputs as the serial one (only their order
in time differs), so bitwise equality is the right check here, in float64 and float32 alike. Every comparison is
between computations of identical shapes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny_model

import sur_lab.executors.packed as packed
from sur_lab.budget import Support
from sur_lab.cache_ops import cache_length, caches_equal, clone_cache, shift_cache, shift_cache_, to_tensors
from sur_lab.edits import token_edit
from sur_lab.executors import dirty, executor_consumes_input, get_executor, shift, shift_inplace
from sur_lab.forward import forward_tokens
from sur_lab.repair import OVERLAP_METHODS, prepare, recover, repair

INPLACE_FORMS = ["sequential", "packed-sdpa", "packed-sdpa-split", "packed-flex-eager", "direct-sequential", "one-shot"]


def _edit(lm, n_original=72, prefix_len=9, deleted_len=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, lm.spec.vocab_size, (n_original,), generator=gen)
    return token_edit(ids, prefix_len, deleted_len, torch.randint(0, lm.spec.vocab_size, (4,), generator=gen))


@pytest.fixture(scope="module", params=[("llama", torch.float64), ("qwen3", torch.float64), ("llama", torch.float32)],
                ids=["llama-f64", "qwen3-f64", "llama-f32"])
def case(request):
    kind, dtype = request.param
    lm = make_tiny_model(kind, dtype=dtype)
    edit = _edit(lm)
    dirty_cache = dirty(lm, edit)
    return lm, edit, dirty_cache, shift(lm, dirty_cache, edit)


def _support(suffix_len: int) -> Support:
    return Support(np.r_[0:3, 10:14, 30:31, 40:47, suffix_len - 2 : suffix_len], suffix_len)


def _rows_outside(cache, rows: np.ndarray):
    keep = torch.ones(cache_length(cache), dtype=torch.bool)
    keep[torch.as_tensor(rows)] = False
    return [(k[:, :, keep].clone(), v[:, :, keep].clone()) for k, v in to_tensors(cache)]


@pytest.mark.parametrize(
    "name, split_cost", [(name, None) for name in INPLACE_FORMS] + [("packed-sdpa-split", 0)]
)
def test_inplace_refresh_equals_cloning_path_bitwise(case, name, split_cost, monkeypatch):
    lm, edit, _, shift_cache_ref = case
    if split_cost is not None:
        monkeypatch.setattr(packed, "SPLIT_CALL_COST", split_cost)  # several key segments on a tiny context
    support = _support(edit.suffix_len)
    expected = get_executor(name)(lm, shift_cache_ref, edit, support)
    owned = clone_cache(shift_cache_ref)
    kept_before = _rows_outside(owned, support.absolute(edit.prefix_len))
    out = get_executor(name, inplace=True)(lm, owned, edit, support)
    assert out is owned  # the input is consumed: written in place, returned, no output clone
    assert caches_equal(out, expected)
    for (k, v), (kk, vk) in zip(_rows_outside(out, support.absolute(edit.prefix_len)), kept_before):
        assert torch.equal(k, kk) and torch.equal(v, vk)  # every unselected row keeps its bits


def test_inplace_registry(case):
    assert executor_consumes_input("packed-inplace") and not executor_consumes_input("packed")
    assert get_executor("packed-sdpa", inplace=True) is get_executor("packed-sdpa-inplace")
    with pytest.raises(ValueError, match="no in-place form"):
        get_executor("no-such-executor", inplace=True)
    with pytest.raises(ValueError, match="unknown executor"):
        executor_consumes_input("no-such-executor")


def test_inplace_empty_support_returns_input(case):
    lm, edit, _, shift_ref = case
    owned = clone_cache(shift_ref)
    out = get_executor("packed", inplace=True)(lm, owned, edit, Support(np.zeros(0, dtype=np.int64), edit.suffix_len))
    assert out is owned and caches_equal(out, shift_ref)


def test_shift_inplace_equals_shift_bitwise(case):
    lm, edit, dirty_cache, shift_ref = case
    owned = clone_cache(dirty_cache)
    out = shift_inplace(lm, owned, edit)
    assert out is owned and cache_length(out) == edit.edited_len
    assert caches_equal(out, shift_ref)
    # the function in cache_ops directly, at another deletion
    owned = clone_cache(dirty_cache)
    assert caches_equal(shift_cache_(owned, 3, 20, lm.inv_freq), shift_cache(dirty_cache, 3, 20, lm.inv_freq))


def test_shift_inplace_refuses_before_modifying(case):
    lm, edit, dirty_cache, _ = case
    owned = clone_cache(dirty_cache)
    with pytest.raises(ValueError, match="deleted_len"):
        shift_cache_(owned, 3, 0, lm.inv_freq)
    with pytest.raises(ValueError, match="dirty_cache has"):
        shift_inplace(lm, shift_cache(owned, 3, 2, lm.inv_freq), edit)
    assert caches_equal(owned, dirty_cache)


@pytest.mark.parametrize("executor", ["sequential", "packed"])
def test_repair_inplace_equals_cloning_and_consumes(case, executor):
    lm, edit, _, _ = case
    reference = repair(lm, prepare(lm, edit), "SUR", 20.0, executor=executor)
    prepared = prepare(lm, edit)
    result = repair(lm, prepared, "SUR", 20.0, executor=executor, inplace=True)
    assert prepared.shift_cache is None  # consumed: it became the output
    assert caches_equal(result.cache, reference.cache)
    np.testing.assert_array_equal(result.support.positions, reference.support.positions)
    with pytest.raises(ValueError, match="consumed"):
        repair(lm, prepared, "Shift", inplace=True)
    # B = 0 and Shift hand back the prepared cache itself
    prepared = prepare(lm, edit)
    own = prepared.shift_cache
    assert repair(lm, prepared, "SUR", 0.0, executor=executor, inplace=True).cache is own


def test_repair_inplace_refuses_executor_without_inplace_form(case, monkeypatch):
    from sur_lab.executors import EXECUTORS, refresh_sequential

    lm, edit, _, _ = case
    prepared = prepare(lm, edit)
    # A registered executor with no "-inplace" form (every built-in one has one).
    monkeypatch.setitem(EXECUTORS, "copy-only", refresh_sequential)
    with pytest.raises(ValueError, match="no in-place form"):
        repair(lm, prepared, "SUR", 20.0, executor="copy-only", inplace=True)
    assert prepared.shift_cache is not None


def _query_logits(lm, edit, cache):
    return forward_tokens(lm, edit.query_ids, clone_cache(cache), logits="all")


@pytest.mark.parametrize("method", ["SUR", "Dense tokens"])
def test_overlap_bitwise_equal_to_serial(case, method):
    lm, edit, dirty_cache, _ = case
    serial = recover(lm, edit, dirty_cache, method, 20.0, executor="packed")
    overlapped = recover(lm, edit, dirty_cache, method, 20.0, executor="packed", overlap=True)
    np.testing.assert_array_equal(serial.support.positions, overlapped.support.positions)
    assert caches_equal(serial.shift_cache, overlapped.shift_cache)
    assert caches_equal(serial.cache, overlapped.cache)
    assert torch.equal(_query_logits(lm, edit, serial.cache), _query_logits(lm, edit, overlapped.cache))
    assert set(overlapped.timings_ms) == {"select", "shift", "refresh", "recovery"}
    # diagnostics (SUR's token scores) agree too
    for key in ("token_scores", "unit_scores"):
        if key in serial.selection.diagnostics:
            np.testing.assert_array_equal(serial.selection.diagnostics[key], overlapped.selection.diagnostics[key])


def test_recover_matches_prepare_repair_and_inplace(case):
    lm, edit, dirty_cache, _ = case
    reference = repair(lm, prepare(lm, edit), "SUR", 20.0, executor="packed")
    serial = recover(lm, edit, dirty_cache, "SUR", 20.0, executor="packed")
    assert caches_equal(serial.cache, reference.cache)
    owned = clone_cache(dirty_cache)
    inplace = recover(lm, edit, owned, "SUR", 20.0, executor="packed", overlap=True, inplace=True)
    assert inplace.cache is owned and inplace.shift_cache is None
    assert caches_equal(inplace.cache, reference.cache)


def test_recover_refuses_bad_input_before_work(case):
    lm, edit, dirty_cache, _ = case
    with pytest.raises(ValueError, match="overlap=True"):
        recover(lm, edit, dirty_cache, "CacheBlend-Adapted", 20.0, overlap=True)
    with pytest.raises(ValueError, match="unknown method"):
        recover(lm, edit, dirty_cache, "Shift", 20.0)
    with pytest.raises(ValueError, match="no in-place form"):
        recover(lm, edit, dirty_cache, "SUR", 20.0, executor="nonexistent", inplace=True)
    with pytest.raises(ValueError, match="dirty_cache has"):
        recover(lm, edit, shift(lm, dirty_cache, edit), "SUR", 20.0)
    assert "SUR" in OVERLAP_METHODS


def test_prepare_overlap_builds_the_same_units(case):
    lm, edit, _, _ = case
    serial, overlapped = prepare(lm, edit), prepare(lm, edit, overlap=True)
    assert overlapped.units is not None and overlapped.units == serial.get_units()
    assert caches_equal(serial.shift_cache, overlapped.shift_cache)
