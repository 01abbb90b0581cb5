"""Exactness of the reference operators and the sequential executor in float64 on tiny random Llama and Qwen3 models
(appendix 7.1). Layer 0 has no contextual input, so Shift's layer-0 suffix K/V must equal Re-prefill's; a full-budget
sequential refresh is Replay; Replay and Re-prefill run the same arithmetic on the same history."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_tiny_model
from sur_lab.answer import answer
from sur_lab.budget import Support
from sur_lab.cache_ops import (
    caches_equal, clone_cache, from_tensors, layer_kv, max_abs_diff, rerotate_keys, to_tensors,
)
from sur_lab.edits import token_edit
from sur_lab.executors import refresh_sequential, replay, reprefill
from sur_lab.forward import forward_tokens
from sur_lab.repair import prepare, repair

EXACT = 1e-10  # float64 with float64 RoPE angles: differences are pure rounding (~1e-15)
CLOSE = 1e-8


def make_edit(n=48, p=12, d=7, q=5, seed=1, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return token_edit(torch.randint(0, vocab, (n,), generator=g), p, d, torch.randint(0, vocab, (q,), generator=g))


@pytest.fixture
def case(tiny_lm):
    edit = make_edit()
    return tiny_lm, edit, prepare(tiny_lm, edit)


def test_shift_layer0_equals_reprefill(case):
    lm, edit, prep = case
    ref = reprefill(lm, edit)
    k_s, v_s = layer_kv(prep.shift_cache, 0)
    k_r, v_r = layer_kv(ref, 0)
    assert (k_s - k_r).abs().max().item() <= EXACT
    assert (v_s - v_r).abs().max().item() <= EXACT


def test_shift_leaves_deeper_layers_stale(case):
    lm, edit, prep = case
    ref = replay(lm, prep.dirty_cache, edit)
    k_s, _ = layer_kv(prep.shift_cache, lm.spec.num_layers - 1)
    k_r, _ = layer_kv(ref, lm.spec.num_layers - 1)
    assert (k_s[:, :, edit.suffix_slice] - k_r[:, :, edit.suffix_slice]).abs().max().item() > 1e-3


def test_full_refresh_equals_replay_equals_reprefill(case):
    lm, edit, prep = case
    full = refresh_sequential(lm, prep.shift_cache, edit, Support.full(edit.suffix_len))
    rep = replay(lm, prep.dirty_cache, edit)
    pre = reprefill(lm, edit)
    assert max(max_abs_diff(full, rep)) <= CLOSE
    assert max(max_abs_diff(rep, pre)) <= CLOSE
    logits = [answer(lm, c, edit, max_new_tokens=1).first_token_logits for c in (full, rep, pre)]
    assert (logits[0] - logits[1]).abs().max().item() <= CLOSE
    assert (logits[1] - logits[2]).abs().max().item() <= CLOSE


def test_budget_zero_is_shift_and_full_budget_is_replay(case):
    lm, edit, prep = case
    r0 = repair(lm, prep, "SUR", 0)
    assert r0.allowance == 0 and caches_equal(r0.cache, prep.shift_cache)
    r100 = repair(lm, prep, "SUR", 100)
    assert r100.allowance == edit.suffix_len
    assert caches_equal(r100.cache, replay(lm, prep.dirty_cache, edit))


def test_refreshing_a_suffix_head_reproduces_replay_there(case):
    # Positions 0..k-1 of the suffix see only the valid prefix and each other, so their refreshed rows are exact.
    lm, edit, prep = case
    k = 9
    out = refresh_sequential(lm, prep.shift_cache, edit, Support(np.arange(k), edit.suffix_len))
    rows = slice(edit.prefix_len, edit.prefix_len + k)
    assert max(max_abs_diff(out, replay(lm, prep.dirty_cache, edit), rows)) <= CLOSE


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_sequential_keeps_unselected_rows_and_inputs(data):
    kind = data.draw(st.sampled_from(["llama", "qwen3"]))
    lm = _models()[kind]
    edit = make_edit(seed=data.draw(st.integers(0, 10_000)))
    prep = _prepared(kind, edit)
    S = edit.suffix_len
    positions = sorted(data.draw(st.sets(st.integers(0, S - 1), min_size=1, max_size=S)))
    support = Support(np.array(positions), S)
    shift_before = clone_cache(prep.shift_cache)
    out = refresh_sequential(lm, prep.shift_cache, edit, support)
    assert caches_equal(shift_before, prep.shift_cache), "input cache mutated"
    keep = np.ones(edit.edited_len, dtype=bool)
    keep[support.absolute(edit.prefix_len)] = False
    for layer in range(lm.spec.num_layers):
        (k_o, v_o), (k_s, v_s) = layer_kv(out, layer), layer_kv(prep.shift_cache, layer)
        assert torch.equal(k_o[:, :, keep], k_s[:, :, keep]) and torch.equal(v_o[:, :, keep], v_s[:, :, keep])
    # Selected rows did change at the last layer (they were stale).
    k_o, _ = layer_kv(out, lm.spec.num_layers - 1)
    k_s, _ = layer_kv(prep.shift_cache, lm.spec.num_layers - 1)
    sel = support.absolute(edit.prefix_len)
    assert (k_o[:, :, sel] - k_s[:, :, sel]).abs().max().item() > 0


_MODEL_CACHE: dict = {}


def _models():
    if not _MODEL_CACHE:
        _MODEL_CACHE.update({k: make_tiny_model(k) for k in ("llama", "qwen3")})
    return _MODEL_CACHE


def _prepared(kind, edit):
    return prepare(_models()[kind], edit)


def test_no_operator_mutates_its_input(case):
    lm, edit, prep = case
    dirty_before, shift_before = clone_cache(prep.dirty_cache), clone_cache(prep.shift_cache)
    for method, b in [("Shift", 0), ("Replay", 0), ("Re-prefill", 0), ("Dirty", 0), ("SUR", 30), ("SUR", 100)]:
        result = repair(lm, prep, method, b)
        answer(lm, result.cache, edit, max_new_tokens=2)
        assert caches_equal(prep.dirty_cache, dirty_before), method
        assert caches_equal(prep.shift_cache, shift_before), method
    cache_before = clone_cache(prep.shift_cache)
    answer(lm, prep.shift_cache, edit, max_new_tokens=3)
    assert caches_equal(prep.shift_cache, cache_before)


def test_from_tensors_holds_the_given_tensors_and_clone_copies_once(case):
    lm, edit, prep = case
    layers = to_tensors(prep.shift_cache)
    held = from_tensors(layers)
    # The cache holds the very tensors (no copy: the output clone of an executor is its only copy of the cache).
    assert all(k is hk and v is hv for (k, v), (hk, hv) in zip(layers, to_tensors(held)))
    assert held.get_seq_length() == edit.edited_len
    copy = clone_cache(prep.shift_cache)
    assert caches_equal(copy, prep.shift_cache)
    assert all(k.data_ptr() != ck.data_ptr() for (k, _), (ck, _) in zip(layers, to_tensors(copy)))
    # Appending to a held cache (a forward) extends it and leaves the given tensors untouched.
    before = clone_cache(prep.shift_cache)
    forward_tokens(lm, edit.query_ids[:2], held, logits="none")
    assert held.get_seq_length() == edit.edited_len + 2
    assert caches_equal(prep.shift_cache, before)


def test_rerotation_composes_and_matches_model_rope():
    lm = make_tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 5, 16, generator=g, dtype=torch.float64)
    once = rerotate_keys(keys, -7, lm.inv_freq)
    twice = rerotate_keys(rerotate_keys(keys, -3, lm.inv_freq), -4, lm.inv_freq)
    assert (once - twice).abs().max().item() <= EXACT
    assert (rerotate_keys(once, 7, lm.inv_freq) - keys).abs().max().item() <= EXACT
    # The model's own RoPE at position 11 equals ours rotating position-0 keys by +11.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = lm.model.model.rotary_emb(keys, torch.tensor([[11] * 5]))
    _, theirs = apply_rotary_pos_emb(keys, keys, cos, sin)
    assert (theirs - rerotate_keys(keys, 11, lm.inv_freq)).abs().max().item() <= EXACT
