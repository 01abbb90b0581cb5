"""Appendix 14 (mixed-cache bound), appendix 13.1 (cost model) and the staleness measures.

Closed-form cases on hand-built tensors; the bound on random tiny float64 models (hypothesis), with Eq. 28 exact when
attention is held fixed; the capture checked against the model's own attention outputs; causal-pair counts against
brute force and Eq. 18.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sur_lab.budget import Support, allowance, spread_support
from sur_lab.cache_ops import caches_equal
from sur_lab.edits import token_edit
from sur_lab.executors import refresh_sequential, replay
from sur_lab.repair import prepare
from sur_lab.studies.staleness import (
    DENSE_TOKENS,
    distance_profile,
    kv_deviation,
    method_support,
    residual_by_budget,
)
from sur_lab.studies.theory import (
    AttentionCapture,
    bound_rows,
    bound_summary,
    causal_pairs,
    cost_table,
    fit_traversal_model,
    max_pairs,
    mixed_cache_bound,
    pair_flops,
    pair_ratio_bound,
    refresh_with_queries,
    replay_pairs,
    replay_with_queries,
    token_flops,
    token_layer_ratio,
    useful_flops,
)

EPS = torch.finfo(torch.float64).eps
T = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------------------------------------------------------------
# Closed forms


def test_single_key_terms():
    # One key: both attentions are 1, so the left side is exactly ‖Δv‖ and the logit term is pure slack.
    terms = mixed_cache_bound(T([[1.0, 0.0]]), T([[2.0, 0.0]]), T([[1.0, 1.0]]),
                              T([[0.0, 0.0]]), T([[2.0, 0.0]]), T([[1.0, 0.0]]), [0], scaling=1.0)
    assert terms.lhs.item() == 1.0
    assert terms.value_term.item() == 1.0 and terms.approx28.item() == 1.0
    assert terms.m_v.item() == 1.0
    assert terms.logit_dev.item() == 2.0 and terms.logit_term.item() == 4.0
    assert terms.bound25.item() == 5.0 and terms.alpha_l1.item() == 0.0 and terms.bound27.item() == 1.0
    assert terms.q_ref_norm.item() == 0.0 and terms.k_ref_max.item() == 2.0
    assert terms.dq_norm.item() == 1.0 and terms.dk_max.item() == 0.0
    assert terms.logit_bound26.item() == 2.0 and terms.bound25_26.item() == 5.0


def test_logit_only_terms():
    # Keys ±e1, values e1 and e2, q⋆ = 0 and q^A = t e1: α^A = (σ(2t), σ(-2t)), α⋆ = (1/2, 1/2), Δv = 0.
    t = 0.7
    k = T([[1.0, 0.0], [-1.0, 0.0]])
    v = T([[1.0, 0.0], [0.0, 1.0]])
    terms = mixed_cache_bound(T([[t, 0.0]]), k, v, T([[0.0, 0.0]]), k, v, [1], scaling=1.0)
    gap = _sigmoid(2 * t) - 0.5
    assert terms.lhs.item() == pytest.approx(math.sqrt(2) * gap, rel=1e-14)
    assert terms.value_term.item() == 0.0 and terms.approx28.item() == 0.0
    assert terms.logit_dev.item() == pytest.approx(t, rel=1e-15)
    assert terms.bound25.item() == pytest.approx(2 * t, rel=1e-15)
    assert terms.alpha_l1.item() == pytest.approx(2 * gap, rel=1e-14)
    assert terms.bound27.item() == pytest.approx(2 * gap, rel=1e-14)
    # Eq. 26 is tight here: K⋆‖Δq‖ = t and Δk = 0.
    assert terms.logit_bound26.item() == pytest.approx(t, rel=1e-15)
    assert terms.bound25_26.item() == pytest.approx(2 * t, rel=1e-15)


def test_future_keys_are_masked():
    t = 0.7
    k = T([[1.0, 0.0], [-1.0, 0.0]])
    v = T([[1.0, 0.0], [0.0, 1.0]])
    base = mixed_cache_bound(T([[t, 0.0]]), k, v, T([[0.0, 0.0]]), k, v, [1], scaling=1.0)
    # A third row that differs wildly between the caches sits after the query and must not change any term.
    k_a, v_a = torch.cat((k, T([[50.0, 3.0]]))), torch.cat((v, T([[9.0, -9.0]])))
    k_r, v_r = torch.cat((k, T([[-7.0, 1.0]]))), torch.cat((v, T([[0.0, 20.0]])))
    masked = mixed_cache_bound(T([[t, 0.0]]), k_a, v_a, T([[0.0, 0.0]]), k_r, v_r, [1], scaling=1.0)
    for name in ("lhs", "bound25", "bound27", "logit_bound26", "m_v", "k_ref_max", "dk_max", "approx28"):
        assert getattr(masked, name).item() == getattr(base, name).item(), name


def test_fixed_attention_with_parallel_deviation_is_tight():
    # Same q and K in both caches (α^A = α⋆) and Δv_j = c for all j: ‖o^A − o⋆‖ = ‖c‖ = Σ α ‖Δv‖ (Eq. 28 equality).
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((3, 4), (6, 4), (6, 4)))
    c = T([3.0, 4.0, 0.0, 0.0])
    terms = mixed_cache_bound(q, k, v + c, q, k, v, [2, 4, 5])
    assert torch.equal(terms.logit_dev, torch.zeros(3)) and torch.equal(terms.alpha_l1, torch.zeros(3))
    assert torch.equal(terms.bound25, terms.approx28) and torch.equal(terms.bound27, terms.approx28)
    torch.testing.assert_close(terms.lhs, torch.full((3,), 5.0, dtype=torch.float64), rtol=8 * EPS, atol=0)
    torch.testing.assert_close(terms.approx28, torch.full((3,), 5.0, dtype=torch.float64), rtol=8 * EPS, atol=0)


def test_default_scaling_and_batched_heads():
    g = torch.Generator().manual_seed(1)
    q_a, q_r = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64).unbind(0)
    k_a, k_r, v_a, v_r = torch.randn(4, 3, 7, 8, generator=g, dtype=torch.float64).unbind(0)
    pos = [0, 1, 3, 5, 6]
    batched = mixed_cache_bound(q_a, k_a, v_a, q_r, k_r, v_r, pos)
    explicit = mixed_cache_bound(q_a, k_a, v_a, q_r, k_r, v_r, pos, scaling=8 ** -0.5)
    assert torch.equal(batched.bound25, explicit.bound25)
    head1 = mixed_cache_bound(q_a[1], k_a[1], v_a[1], q_r[1], k_r[1], v_r[1], pos)
    # Batched and per-head matmuls may round differently (different reduction kernels): a few ulps.
    torch.testing.assert_close(batched.lhs[1], head1.lhs, rtol=8 * EPS, atol=0)
    assert bool((batched.lhs <= batched.bound27 + 1e-12).all() and (batched.bound27 <= batched.bound25 + 1e-12).all())


def test_bound_argument_errors():
    x = torch.zeros(2, 4, dtype=torch.float64)
    kv = torch.zeros(5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="positions"):
        mixed_cache_bound(x, kv, kv, x, kv, kv, [0, 5])
    with pytest.raises(ValueError, match="v_ref"):
        mixed_cache_bound(x, kv, kv, x, kv, kv[:4], [0, 1])
    with pytest.raises(ValueError, match="q_a"):
        mixed_cache_bound(x, kv, kv, x[:1], kv, kv, [0, 1])


# ---------------------------------------------------------------------------------------------------------------------
# Tiny models: capture and the bound on real activations


def _case(lm, seed: int, n: int = 40, p: int = 6, d: int = 5, picks=(0, 1, 5, 9, 10, 11, 20, 28)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, lm.spec.vocab_size, (n,), generator=g)
    edit = token_edit(ids, p, d, [3, 4, 5])
    prepared = prepare(lm, edit)
    return prepared, Support(np.array(sorted(picks)), edit.suffix_len)


def test_capture_matches_module_and_leaves_forwards_unchanged(tiny_lm):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    prepared, sup = _case(tiny_lm, 0)
    edit = prepared.edit
    before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    heads = list(range(tiny_lm.spec.num_heads))
    cache_a, q_a = refresh_with_queries(tiny_lm, prepared.shift_cache, edit, sup, [0, 1, 2], heads)
    assert ALL_ATTENTION_FUNCTIONS._local_mapping == before
    assert caches_equal(cache_a, refresh_sequential(tiny_lm, prepared.shift_cache, edit, sup))
    cache_r, q_r = replay_with_queries(tiny_lm, prepared.dirty_cache, edit, [0, 1, 2], heads)
    assert caches_equal(cache_r, replay(tiny_lm, prepared.dirty_cache, edit))
    rows = sup.absolute(edit.prefix_len)
    df = bound_rows(tiny_lm, cache_a, q_a, cache_r, q_r, rows, heads, prefix_len=edit.prefix_len)
    assert len(df) == 3 * len(heads) * len(rows)
    # The float64 recomputation from captured q and cached K/V reproduces the module's own attention output; the
    # tolerance is a few float64 roundings of a d_h-term and an N-term sum of O(1) values.
    assert df["capture_err"].max() < 1e-13
    # The first refreshed interval starts at the cut and reads only the clean prefix: there q^A = q⋆ up to rounding.
    assert set(q_a) == {0, 1, 2}
    first = q_a[2].rows(rows[:2]).queries.double()
    ref = q_r[2].rows(rows[:2]).queries.double()
    torch.testing.assert_close(first, ref, rtol=0, atol=1e-12)


def test_capture_with_eager_attention():
    lm = make_tiny_model("llama", seed=2)
    lm.model.config._attn_implementation = "eager"
    prepared, sup = _case(lm, 1)
    edit = prepared.edit
    cache_a, q_a = refresh_with_queries(lm, prepared.shift_cache, edit, sup, [1, 2], [1, 3])
    cache_r, q_r = replay_with_queries(lm, prepared.dirty_cache, edit, [1, 2], [1, 3])
    df = bound_rows(lm, cache_a, q_a, cache_r, q_r, sup.absolute(edit.prefix_len), [1, 3])
    assert sorted(set(df["layer"])) == [1, 2] and sorted(set(df["kv_head"])) == [0, 1]
    # transformers' eager attention takes its softmax in float32 even for a float64 model, so the module's own output
    # carries float32 rounding (ε₃₂ ≈ 1.2e-7 relative on O(1) values); the float64 recomputation must agree to that.
    assert df["capture_err"].max() < 1e-6 and bool(df["holds"].all())


def test_capture_rejects_bad_layers(tiny_lm):
    with pytest.raises(ValueError, match="layers"):
        AttentionCapture(tiny_lm, [3])
    with pytest.raises(ValueError, match="heads"):
        AttentionCapture(tiny_lm, [0], [7])


_MODELS: dict[str, object] = {}


def _model(kind: str):
    if kind not in _MODELS:
        _MODELS[kind] = make_tiny_model(kind)
    return _MODELS[kind]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["llama", "qwen3"]),
    seed=st.integers(0, 10_000),
    n=st.integers(16, 48),
    p=st.integers(0, 6),
    d=st.integers(1, 6),
    data=st.data(),
)
def test_bound_holds_on_tiny_models(kind, seed, n, p, d, data):
    lm = _model(kind)
    S = n - p - d
    picks = data.draw(st.lists(st.integers(0, S - 1), min_size=1, max_size=S - 1, unique=True))
    prepared, sup = _case(lm, seed, n=n, p=p, d=d, picks=picks)
    edit = prepared.edit
    heads = list(range(lm.spec.num_heads))
    layers = list(range(lm.spec.num_layers))
    cache_a, q_a = refresh_with_queries(lm, prepared.shift_cache, edit, sup, layers, heads)
    cache_r, q_r = replay_with_queries(lm, prepared.dirty_cache, edit, layers, heads)
    rows = sup.absolute(edit.prefix_len)
    df = bound_rows(lm, cache_a, q_a, cache_r, q_r, rows, heads, prefix_len=edit.prefix_len)
    # Eq. 25 and its chain, within float64 rounding of the sums (bound_rounding_allowance).
    assert bool((df["lhs"] <= df["bound27"] + df["allowance"]).all())
    assert bool((df["bound27"] <= df["bound25"] + df["allowance"]).all())
    assert bool((df["bound25"] <= df["bound25_26"] + df["allowance"]).all())
    # Eq. 26: logits are d_h-term dot products of magnitude scaling·‖q‖‖k‖; allow 4·d_h·ε of that magnitude.
    d_h = lm.spec.head_dim
    logit_scale = d_h ** -0.5 * (df["q_ref_norm"] + df["dq_norm"]) * (df["k_ref_max"] + df["dk_max"])
    assert bool((df["logit_dev"] <= df["logit_bound26"] + 4 * d_h * EPS * logit_scale).all())
    assert bound_summary(df.assign(label="x"))["violations_beyond_rounding"].item() == 0

    # Attention held fixed (q and K from Replay, V from the mixed cache): Eq. 25 collapses to Eq. 28 exactly.
    from sur_lab.cache_ops import layer_kv

    pos = torch.as_tensor(rows)
    for layer in layers:
        kv = torch.tensor([h // lm.spec.gqa_group for h in heads])
        k_r, v_r = (t[0, kv] for t in layer_kv(cache_r, layer))
        v_a = layer_kv(cache_a, layer)[1][0, kv]
        q = q_r[layer].rows(pos).queries
        fixed = mixed_cache_bound(q, k_r, v_a, q, k_r, v_r, pos)
        assert torch.equal(fixed.logit_dev, torch.zeros_like(fixed.logit_dev))
        assert torch.equal(fixed.bound25, fixed.approx28) and torch.equal(fixed.bound27, fixed.approx28)
        # ‖Σ α Δv‖ ≤ Σ α ‖Δv‖ up to the rounding of an N-term float64 sum (N = pos + 1 keys).
        assert bool((fixed.lhs <= fixed.approx28 * (1 + 4 * (pos.double() + 1) * EPS)).all())


# ---------------------------------------------------------------------------------------------------------------------
# Cost model


def _brute_pairs(positions, n_rows):
    return sum(1 for u in positions for j in range(n_rows) if j <= u)


@settings(max_examples=60, deadline=None)
@given(P=st.integers(0, 30), S=st.integers(1, 40), data=st.data())
def test_causal_pairs_brute_force_and_bound(P, S, data):
    local = data.draw(st.lists(st.integers(0, S - 1), unique=True, max_size=S))
    sup = Support.from_unsorted(local, S)
    B = sup.size
    u = sup.absolute(P)
    m = causal_pairs(u)
    assert m == _brute_pairs(u, P + S)
    assert m <= max_pairs(P, S, B)
    assert m / replay_pairs(P, S) <= pair_ratio_bound(B, S) + 1e-15
    last = np.arange(P + S - B, P + S)
    assert causal_pairs(last) == max_pairs(P, S, B)
    assert replay_pairs(P, S) == causal_pairs(np.arange(P, P + S)) == _brute_pairs(range(P, P + S), P + S)


def test_cost_model_flops_and_ratios(tiny_lm):
    cfg = tiny_lm.model.config  # d = 48, H_Q = 4, H_KV = 2, d_h = 16, d_ff = 96, L = 3
    assert token_flops(cfg) == 2 * 2 * 48 * 64 + 2 * 2 * 48 * 32 + 2 * 3 * 48 * 96
    assert pair_flops(tiny_lm) == 2 * 2 * 4 * 16
    P, S = 10, 20
    u = np.array([12, 13, 25])
    assert useful_flops(tiny_lm, P, u) == 3 * (3 * token_flops(cfg) + pair_flops(cfg) * (13 + 14 + 26))
    assert token_layer_ratio(3, 20) == 0.15
    with pytest.raises(ValueError, match="positions"):
        useful_flops(tiny_lm, P, [9])
    with pytest.raises(ValueError, match="allowance_b"):
        token_layer_ratio(21, 20)
    edit = token_edit(torch.arange(35) % 90, P, 5, [1])
    table = cost_table(tiny_lm, edit, {"a": Support(u - P, S), "full": Support.full(S)})
    full = table.set_index("label").loc["full"]
    assert full["flops_ratio"] == 1.0 and full["pair_ratio"] == 1.0 and full["token_layer_ratio"] == 1.0
    a = table.set_index("label").loc["a"]
    assert a["pairs"] == 53 and a["pair_ratio"] <= a["pair_ratio_max"] <= a["pair_ratio_bound"]


def test_spread_support():
    sup = spread_support(100, 13, 4)
    assert sup.size == 13 and sup.num_intervals == 4
    assert [b - a for a, b in sup.intervals] == [4, 3, 3, 3]
    assert spread_support(100, 13, 1).intervals == [(0, 13)]
    with pytest.raises(ValueError, match="num_intervals"):
        spread_support(100, 13, 14)
    with pytest.raises(ValueError, match="num_intervals"):
        spread_support(20, 17, 5)  # intervals of 4 positions every 4 tokens would touch
    with pytest.raises(ValueError, match="allowance_b=11 exceeds suffix_len=10"):
        spread_support(10, 11, 2)


@pytest.mark.parametrize("packed", [False, True])
def test_traversal_fit_recovers_known_model(packed):
    # Noise-free times generated from Eq. 19 with known parameters are fitted back exactly (to solver precision).
    h, c0, cb, cm, cb_p, cm_p = 12.0, 30.0, 0.8, 2e-4, 0.1, 5e-5
    rows = []
    for B in (40, 90, 160):
        for R in (1, 2, 4, 8, 16, 32):
            pairs = B * 1500 + 37 * R * B
            rows.append({"executor": "sequential", "R": R, "B": B, "pairs": pairs,
                         "ms": c0 + R * h + cb * B + cm * pairs})
            if packed:
                rows.append({"executor": "packed-sdpa", "R": R, "B": B, "pairs": pairs,
                             "ms": c0 + h + cb_p * B + cm_p * pairs})
    fit = fit_traversal_model(pd.DataFrame(rows))
    assert fit.h_ms == pytest.approx(h, rel=1e-6) and fit.c0_ms == pytest.approx(c0, rel=1e-6)
    assert fit.per_position_ms["sequential"] == pytest.approx(cb, rel=1e-6)
    assert fit.per_pair_ms["sequential"] == pytest.approx(cm, rel=1e-6)
    if packed:
        assert fit.per_position_ms["packed-sdpa"] == pytest.approx(cb_p, rel=1e-6)
        assert fit.per_pair_ms["packed-sdpa"] == pytest.approx(cm_p, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0, abs=1e-9)
    df = pd.DataFrame(rows)
    np.testing.assert_allclose(fit.predict("sequential", df["R"], df["B"], df["pairs"])[df["executor"] == "sequential"],
                               df.loc[df["executor"] == "sequential", "ms"], rtol=1e-6)
    with pytest.raises(ValueError, match="ms"):
        fit_traversal_model(df.drop(columns="ms"))


# ---------------------------------------------------------------------------------------------------------------------
# Staleness


def test_kv_deviation_locates_staleness(tiny_lm):
    prepared, _ = _case(tiny_lm, 3)
    edit = prepared.edit
    ref = replay(tiny_lm, prepared.dirty_cache, edit)
    zero = kv_deviation(ref, ref, edit)
    assert not zero.keys.any() and not zero.values.any()
    dev = kv_deviation(prepared.shift_cache, ref, edit)
    assert dev.keys.shape == (tiny_lm.spec.num_layers, edit.suffix_len)
    # Layer 0 K/V are token-local: after re-rotation (float64 angles) they equal Replay's up to a few roundings.
    assert dev.relative_keys[0].max() < 1e-13 and dev.relative_values[0].max() < 1e-13
    assert dev.relative_values[1:].max() > 1e-3
    # Refreshing the first k suffix positions (clean context) removes their deviation; later rows stay stale.
    k = 6
    fixed = refresh_sequential(tiny_lm, prepared.shift_cache, edit, Support(np.arange(k), edit.suffix_len))
    after = kv_deviation(fixed, ref, edit)
    assert after.relative_keys[:, :k].max() < 1e-12 and after.relative_values[:, :k].max() < 1e-12
    np.testing.assert_array_equal(after.values[1:, -1] > 0, True)
    prof = distance_profile(dev, num_bins=4)
    assert set(prof["layer"]) == set(range(tiny_lm.spec.num_layers))
    assert prof["n"].sum() == tiny_lm.spec.num_layers * edit.suffix_len
    with pytest.raises(ValueError, match="reference"):
        kv_deviation(prepared.shift_cache, prepared.dirty_cache, edit)


def test_residual_by_budget_endpoints_and_dense_tokens(tiny_lm):
    from sur_lab.allocators import AllocationRequest, top_b
    from sur_lab.allocators.sur import sur_token_scores

    prepared, _ = _case(tiny_lm, 4)
    edit = prepared.edit
    ref = replay(tiny_lm, prepared.dirty_cache, edit)
    df = residual_by_budget(tiny_lm, prepared, ref, [0, 20, 100], executor="sequential", progress=False)
    assert set(df["method"]) == {"SUR", DENSE_TOKENS}
    zero = df[df["budget_pct"] == 0]
    assert (zero["keys_of_shift"] == 1.0).all() and (zero["values_of_shift"] == 1.0).all()
    assert (df[df["budget_pct"] == 100][["keys", "values"]] == 0).all().all()
    mid = df[df["budget_pct"] == 20]
    assert (mid["B"] == allowance(edit.suffix_len, 20)).all() and (mid["values_of_shift"] < 1).all()
    sup = method_support(tiny_lm, prepared, DENSE_TOKENS, 20)
    req = AllocationRequest(tiny_lm, edit, 20, shift_cache=prepared.shift_cache)
    np.testing.assert_array_equal(sup.positions, top_b(sur_token_scores(req), req.allowance))


# ---------------------------------------------------------------------------------------------------------------------
# The notebook's case builder


@pytest.mark.slow
def test_theory_edit_deletes_whole_passages(smol_tokenizer, data_dir):
    from sur_lab.studies.theory import theory_edit

    edit, example = theory_edit(smol_tokenizer, "hotpotqa", num_passages=5, delete_at=1, deletion_width=2, seed=3)
    start, end = edit.deleted_char_span
    deleted = edit.original_text[start:end]
    assert deleted.startswith("Title: ") and deleted.count("Title: ") == 2 and deleted.endswith("\n\n")
    assert edit.suffix_len > 0 and edit.question == example.question
    hay, _ = theory_edit(smol_tokenizer, "haystack", num_passages=4, haystack_passages=6, delete_at=0)
    assert hay.prefix_len > 0 and hay.suffix_len > 0
    with pytest.raises(ValueError, match="delete_at"):
        theory_edit(smol_tokenizer, "hotpotqa", num_passages=3, delete_at=2)
    with pytest.raises(ValueError, match="held-out"):
        theory_edit(smol_tokenizer, "hotpotqa/hotpotqa__v2_test_random_500.jsonl")
