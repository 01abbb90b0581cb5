"""Exactness of the reference operators and the sequential executor in float64 on tiny random Llama and Qwen3 models
(appendix 7.1), against independent oracles: a plain transformers prefill of the edited ids (``hf_prefill``, no
sur_lab code), and for Shift's deeper-layer keys transformers' own RoPE applied at offset -d. Layer 0 has no
contextual input, so Shift's layer-0 suffix K/V must equal a prefill at the new positions; a full-budget repair is a
prefill of the edited ids. Computations of different shapes are compared within ``fp64_tol`` (64 ulp of the
reference's scale, ~6e-14), never bitwise; rows that are copies are compared bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import fp64_tol, hf_prefill, make_tiny_model
from sur_lab.answer import answer
from sur_lab.budget import Support
from sur_lab.cache_ops import (
    caches_equal, clone_cache, from_tensors, layer_kv, rerotate_keys, to_tensors,
)
from sur_lab.edits import token_edit
from sur_lab.executors import refresh_sequential, replay, reprefill
from sur_lab.forward import forward_tokens
from sur_lab.repair import prepare, repair



def make_edit(n=48, p=12, d=7, q=5, seed=1, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return token_edit(torch.randint(0, vocab, (n,), generator=g), p, d, torch.randint(0, vocab, (q,), generator=g))


@pytest.fixture
def case(tiny_lm):
    edit = make_edit()
    return tiny_lm, edit, prepare(tiny_lm, edit)


def _max_diff(ours, oracle, rows=slice(None)):
    """Largest |difference| of keys and values over layers between a cache and oracle ``(K, V)`` pairs."""
    return max(
        max((k[:, :, rows] - ko[:, :, rows]).abs().max().item(), (v[:, :, rows] - vo[:, :, rows]).abs().max().item())
        for (k, v), (ko, vo) in zip(to_tensors(ours), oracle)
    )


def _rope_shift_oracle(lm, keys, delta):
    """Transformers' own RoPE rotating post-RoPE ``keys`` by ``delta`` positions (cos/sin of angle delta·θ)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    n = keys.shape[2]
    cos, sin = lm.model.model.rotary_emb(keys, torch.full((1, n), delta))
    return apply_rotary_pos_emb(keys, keys, cos, sin)[1]


def test_shift_layer0_equals_a_prefill_at_the_new_positions(case):
    lm, edit, prep = case
    oracle, _ = hf_prefill(lm, edit.edited_ids)
    k_s, v_s = layer_kv(prep.shift_cache, 0)
    k_r, v_r = oracle[0]
    tol = fp64_tol(k_r, v_r)
    assert (k_s - k_r).abs().max().item() <= tol
    assert (v_s - v_r).abs().max().item() <= tol


def test_shift_is_the_dirty_prefill_with_the_span_dropped_and_keys_rotated(case):
    lm, edit, prep = case
    p, d = edit.prefix_len, edit.deleted_len
    dirty, _ = hf_prefill(lm, edit.original_ids)
    for layer, ((k_s, v_s), (k_d, v_d)) in enumerate(zip(to_tensors(prep.shift_cache), dirty)):
        tol = fp64_tol(k_d, v_d)
        assert (k_s[:, :, :p] - k_d[:, :, :p]).abs().max().item() <= tol, layer
        assert (v_s[:, :, p:] - v_d[:, :, p + d :]).abs().max().item() <= tol, layer
        rotated = _rope_shift_oracle(lm, k_d[:, :, p + d :], -d)
        assert (k_s[:, :, p:] - rotated).abs().max().item() <= tol, layer


def test_shift_leaves_deeper_layers_stale(case):
    lm, edit, prep = case
    oracle, _ = hf_prefill(lm, edit.edited_ids)
    k_s, _ = layer_kv(prep.shift_cache, lm.spec.num_layers - 1)
    k_r, _ = oracle[-1]
    assert (k_s[:, :, edit.suffix_slice] - k_r[:, :, edit.suffix_slice]).abs().max().item() > 1e-3


def test_full_refresh_replay_and_reprefill_equal_a_plain_prefill(case):
    lm, edit, prep = case
    oracle, logits = hf_prefill(lm, torch.cat((edit.edited_ids, edit.query_ids)))
    pre_query = [(k[:, :, : edit.edited_len], v[:, :, : edit.edited_len]) for k, v in oracle]
    tol = fp64_tol(*[t for kv in pre_query for t in kv])
    full = refresh_sequential(lm, prep.shift_cache, edit, Support.full(edit.suffix_len))
    rep = replay(lm, prep.dirty_cache, edit)
    pre = reprefill(lm, edit)
    for cache in (full, rep, pre):
        assert _max_diff(cache, pre_query) <= tol
        first = answer(lm, cache, edit, max_new_tokens=1).first_token_logits
        # Answer logits are returned in float32: the cast rounds each by at most half a float32 ulp.
        f32_cast = torch.finfo(torch.float32).eps * logits[-1].abs().max().item()
        assert (first.double() - logits[-1]).abs().max().item() <= f32_cast + fp64_tol(logits[-1])


def test_budget_zero_is_shift_and_full_budget_is_replay(case):
    # Against independent oracles, not against repair's own Shift and Replay operators.
    lm, edit, prep = case
    p, d = edit.prefix_len, edit.deleted_len
    r0 = repair(lm, prep, "SUR", 0)
    assert r0.allowance == 0 and r0.support.size == 0
    dirty, _ = hf_prefill(lm, edit.original_ids)
    fresh, _ = hf_prefill(lm, edit.edited_ids)
    tol0 = fp64_tol(*[t for kv in dirty for t in kv])
    assert _max_diff(r0.cache, fresh[:1]) <= tol0  # layer 0: a prefill at the new positions
    shift_oracle = [(torch.cat((k[:, :, :p], _rope_shift_oracle(lm, k[:, :, p + d :], -d)), 2),
                     torch.cat((v[:, :, :p], v[:, :, p + d :]), 2)) for k, v in dirty]
    assert _max_diff(r0.cache, shift_oracle) <= tol0  # every layer: Dirty with the span dropped, keys rotated by -d
    r100 = repair(lm, prep, "SUR", 100)
    assert r100.allowance == edit.suffix_len
    assert _max_diff(r100.cache, fresh) <= fp64_tol(*[t for kv in fresh for t in kv])


def test_an_injected_1e12_attention_error_is_detected(case):
    # The float64 tiny models normalise in float64 (conftest.enable_float64_norm), so the tolerances above resolve
    # fp64 rounding: an error of 1e-12 added to every attention output is far above them.
    lm, edit, prep = case
    oracle, _ = hf_prefill(lm, edit.edited_ids)
    tol = fp64_tol(*[t for kv in oracle for t in kv])
    hooks = [layer.self_attn.o_proj.register_forward_hook(lambda m, a, out: out + 1e-12) for layer in lm.model.model.layers]
    try:
        wrong = repair(lm, prep, "Re-prefill").cache
    finally:
        for h in hooks:
            h.remove()
    assert _max_diff(wrong, oracle) > 100 * tol
    assert _max_diff(repair(lm, prep, "Re-prefill").cache, oracle) <= tol


def test_refreshing_a_suffix_head_reproduces_replay_there(case):
    # Positions 0..k-1 of the suffix see only the valid prefix and each other, so their refreshed rows are exact.
    lm, edit, prep = case
    k = 9
    out = refresh_sequential(lm, prep.shift_cache, edit, Support(np.arange(k), edit.suffix_len))
    rows = slice(edit.prefix_len, edit.prefix_len + k)
    oracle, _ = hf_prefill(lm, edit.edited_ids)
    assert _max_diff(out, oracle, rows) <= fp64_tol(*[t for kv in oracle for t in kv])


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
    # Rotations by different angles round differently: a few ulp of |keys| (~4 here).
    tol = fp64_tol(keys, ulps=16)
    assert (once - twice).abs().max().item() <= tol
    assert (rerotate_keys(once, 7, lm.inv_freq) - keys).abs().max().item() <= tol
    # The model's own RoPE at position 11 equals ours rotating position-0 keys by +11.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = lm.model.model.rotary_emb(keys, torch.tensor([[11] * 5]))
    _, theirs = apply_rotary_pos_emb(keys, keys, cos, sin)
    assert (theirs - rerotate_keys(keys, 11, lm.inv_freq)).abs().max().item() <= tol
