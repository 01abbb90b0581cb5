"""The allocator registry's options and variant names, the exact per-case allowance, SUR's design variants (appendix
9.3), the matched-token protocol (Table 14) and the Fixed blocks / Multiple local windows controls (issue 28).

SUR's defaults are checked against a frozen copy of SUR as it was before the variants were added (commit d1b47a3), so
``top4 + forward + suffix + paper`` is today's SUR on many random cases. The controls are checked against brute-force
oracles written independently of the code under test.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_tiny_model
from sur_lab.allocators import (
    ALLOCATORS,
    TOKEN_LEVEL_ALLOCATORS,
    AllocationRequest,
    allocate,
    allocate_regions,
    allowance_for,
    get_allocator,
    matched_token_selections,
    region_count,
    register_allocator,
    resolve_method,
    variant_name,
)
from sur_lab.allocators import controls
from sur_lab.allocators.sur import context_idf_weights, sur_token_scores, whole_unit_count
from sur_lab.budget import allowance, fractions_expected, prompt_allowance
from sur_lab.edits import token_edit
from sur_lab.repair import prepare, repair
from sur_lab.units import Unit

NEW_ALLOCATORS = {"Edit-local window", "Edit-local + SUR", "Fixed blocks", "Multiple local windows"}


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def llama32():
    return make_tiny_model("llama", dtype=torch.float32)


def random_edit(seed: int, prefix: int, deleted: int, suffix: int, query: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (prefix + deleted + suffix,), generator=g)
    return token_edit(ids, prefix, deleted, torch.randint(0, 96, (query,), generator=g))


def _units(lengths, container=0):
    out, pos = [], 0
    for n in lengths:
        out.append(Unit(pos, pos + n, container))
        pos += n
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Registry, options and variant names


def test_new_allocators_are_registered_and_variants_are_not_listed():
    assert NEW_ALLOCATORS <= set(ALLOCATORS)
    assert {"SUR", "SUR-IDF"} <= set(ALLOCATORS)
    assert "SUR[aggregation=mean]" in ALLOCATORS and "SUR[aggregation=mean]" not in list(ALLOCATORS)
    assert all("[" not in name for name in ALLOCATORS)


@pytest.mark.parametrize(
    "name, resolved",
    [
        ("SUR", ("SUR", {})),
        ("SUR-IDF", ("SUR", {"bonus": "idf"})),
        ("SUR[aggregation=mean]", ("SUR", {"aggregation": "mean"})),
        (" SUR [ partial_unit = prefix , bonus=off ] ", ("SUR", {"partial_unit": "prefix", "bonus": "off"})),
        ("SUR[allowance_base=prompt]", ("SUR", {"allowance_base": "prompt"})),
        ("SUR-IDF[aggregation=mean]", ("SUR", {"bonus": "idf", "aggregation": "mean"})),
        ("Edit-local + SUR[local_share=0.25]", ("Edit-local + SUR", {"local_share": 0.25})),
        ("Fixed blocks[block_len=16]", ("Fixed blocks", {"block_len": 16})),
        ("Multiple local windows[windows=3,bonus=idf]", ("Multiple local windows", {"windows": 3, "bonus": "idf"})),
        ("Dense tokens[bonus=off]", ("Dense tokens", {"bonus": "off"})),
        ("Dense tokens[]", ("Dense tokens", {})),
    ],
)
def test_resolve_method(name, resolved):
    assert resolve_method(name) == resolved
    assert name in ALLOCATORS
    assert callable(get_allocator(name))


@pytest.mark.parametrize(
    "name, message",
    [
        ("SUR[aggregation=median]", "aggregation='median'; allowed: top4, mean"),
        ("SUR[partial_unit=backward]", "partial_unit='backward'; allowed: forward, prefix"),
        ("SUR[bonus=yes]", "bonus='yes'; allowed: paper, idf, off"),
        ("SUR[allowance_base=query]", "allowance_base='query'; allowed: suffix, prompt"),
        ("SUR[window=3]", "'SUR' has no option 'window'"),
        ("SUR[aggregation=mean,aggregation=top4]", "option 'aggregation' twice"),
        ("SUR-IDF[bonus=paper]", "option 'bonus' is fixed by 'SUR-IDF'"),
        ("SUR[aggregation]", "is not option=value"),
        ("SUR[aggregation=mean", "malformed variant name"),
        ("Nope[bonus=off]", "unknown allocator 'Nope'"),
        ("Edit-local + SUR[local_share=1.5]", "local_share='1.5'; allowed: a number in [0, 1]"),
        ("Edit-local + SUR[local_share=nan]", "local_share"),
        ("Fixed blocks[block_len=0]", "block_len"),
        ("Fixed blocks[block_len=2.5]", "block_len"),
        ("Multiple local windows[windows=-1]", "windows"),
        ("Edit-local window[bonus=off]", "'Edit-local window' has no option 'bonus'"),
    ],
)
def test_bad_variant_names_are_refused_naming_the_problem(name, message):
    assert name not in ALLOCATORS
    with pytest.raises(ValueError, match=re.escape(message)):
        get_allocator(name)


def test_unknown_plain_names_list_the_registry():
    with pytest.raises(ValueError, match="unknown allocator name='Nope'; registered: A3-Adapted"):
        get_allocator("Nope")
    assert "Nope" not in ALLOCATORS and 3 not in ALLOCATORS


def test_allocator_names_may_not_hold_brackets():
    with pytest.raises(ValueError, match="brackets"):
        register_allocator("X[y]")


@pytest.mark.parametrize(
    "base, options, name",
    [
        ("SUR", {}, "SUR"),
        ("SUR", {"aggregation": "top4", "partial_unit": "forward", "bonus": "paper", "allowance_base": "suffix"}, "SUR"),
        ("SUR", {"bonus": "idf"}, "SUR-IDF"),
        ("SUR", {"bonus": "off", "aggregation": "mean"}, "SUR[aggregation=mean,bonus=off]"),
        ("SUR", {"allowance_base": "prompt", "partial_unit": "prefix"}, "SUR[partial_unit=prefix,allowance_base=prompt]"),
        ("SUR-IDF", {"aggregation": "mean"}, "SUR[aggregation=mean,bonus=idf]"),
        ("Edit-local + SUR", {"local_share": 0.5}, "Edit-local + SUR"),
        ("Edit-local + SUR", {"local_share": 0.25}, "Edit-local + SUR[local_share=0.25]"),
        ("Fixed blocks", {"block_len": 32}, "Fixed blocks[block_len=32]"),
    ],
)
def test_variant_name_is_canonical_and_round_trips(base, options, name):
    assert variant_name(base, **options) == name
    assert resolve_method(name) == resolve_method(variant_name(*[resolve_method(name)[0]], **resolve_method(name)[1]))


def test_options_from_the_request_and_from_the_name_agree_and_are_validated(llama):
    edit = random_edit(1, 10, 4, 200)
    by_name = allocate("SUR[aggregation=mean,partial_unit=prefix]", AllocationRequest(llama, edit, 5))
    by_options = allocate("SUR", AllocationRequest(llama, edit, 5, options={"aggregation": "mean", "partial_unit": "prefix"}))
    assert by_name.support == by_options.support
    # The name's binding wins over the request's options.
    assert allocate("SUR[aggregation=top4]", AllocationRequest(llama, edit, 5, options={"aggregation": "mean"})).support == (
        allocate("SUR", AllocationRequest(llama, edit, 5)).support
    )
    with pytest.raises(ValueError, match="option aggregation='median'"):
        allocate("SUR", AllocationRequest(llama, edit, 5, options={"aggregation": "median"}))


def test_variant_names_run_through_the_dispatcher(llama):
    edit = random_edit(2, 6, 3, 120)
    prepared = prepare(llama, edit)
    result = repair(llama, prepared, "SUR[aggregation=mean]", 10)
    expected = allocate("SUR", AllocationRequest(llama, edit, 10, options={"aggregation": "mean"}))
    assert result.support == expected.support and result.allowance == 12


# ---------------------------------------------------------------------------------------------------------------------
# Exact per-case allowance


def test_every_allocator_honours_an_exact_allowance(llama):
    edit = random_edit(3, 7, 4, 40)
    prepared = prepare(llama, edit)
    names = sorted(ALLOCATORS) + ["SUR[aggregation=mean,partial_unit=prefix]", "Fixed blocks[block_len=8]"]
    for name in names:
        for count in (0, 1, 7, 39, 40):
            request = AllocationRequest(
                llama, edit, allowance=count, shift_cache=prepared.shift_cache, seed=4,
                options={"dirty_cache": prepared.dirty_cache},
            )
            pos = allocate(name, request).support.positions
            assert len(pos) == count == len(np.unique(pos)), (name, count)


def test_exact_allowance_overrides_the_budget_and_is_validated(llama):
    edit = random_edit(4, 5, 2, 30)
    assert AllocationRequest(llama, edit, 5).allowance == 2
    request = AllocationRequest(llama, edit, 5, allowance=9)
    assert (request.allowance, request.budget_pct) == (9, 5.0)
    only = AllocationRequest(llama, edit, allowance=np.int64(30))
    assert (only.allowance, only.budget_pct) == (30, None) and type(only.allowance) is int
    for bad in (-1, 31):
        with pytest.raises(ValueError, match=r"allowance must be in \[0, 30\]"):
            AllocationRequest(llama, edit, allowance=bad)
    for bad in (2.0, True, "3"):
        with pytest.raises(TypeError, match="allowance must be an integer"):
            AllocationRequest(llama, edit, allowance=bad)
    with pytest.raises(ValueError, match="budget_pct .* or allowance"):
        AllocationRequest(llama, edit)
    with pytest.raises(ValueError, match="allowance_base"):
        AllocationRequest(llama, edit, 5, allowance_base="query")
    with pytest.raises(ValueError, match="budget_pct"):
        AllocationRequest(llama, edit, 101, allowance=3)


def test_prompt_allowance_base(llama):
    edit = random_edit(5, 70, 5, 30)  # p + S = 100
    request = AllocationRequest(llama, edit, 10, allowance_base="prompt")
    assert request.allowance == 10 == prompt_allowance(30, 100, 10) and allowance(30, 10) == 3
    assert AllocationRequest(llama, edit, 40, allowance_base="prompt").allowance == 30  # capped at S
    assert AllocationRequest(llama, edit, 10, allowance=4, allowance_base="prompt").allowance == 4  # exact wins
    no_prefix = random_edit(5, 0, 5, 30)
    assert AllocationRequest(llama, no_prefix, 10, allowance_base="prompt").allowance == allowance(30, 10)
    sel = allocate("SUR[allowance_base=prompt]", AllocationRequest(llama, edit, 10))
    assert sel.support.size == 10 and sel.diagnostics["options"]["allowance_base"] == "prompt"
    # What a dispatcher reads before allocating: B of the method on this request.
    suffix_request = AllocationRequest(llama, edit, 10)
    assert allowance_for("SUR[allowance_base=prompt]", suffix_request) == 10
    assert allowance_for("SUR", suffix_request) == 3 == allowance_for("SUR[aggregation=mean]", suffix_request)
    assert allowance_for("SUR[allowance_base=prompt]", AllocationRequest(llama, edit, 10, allowance=4)) == 4


@settings(max_examples=200)
@given(st.integers(0, 500), st.integers(0, 500), st.integers(0, 10_000))
def test_prompt_allowance_matches_a_brute_force_search(S, p, b_hundredths):
    from fractions import Fraction

    b = Fraction(b_hundredths, 100)
    typed = b_hundredths // 100 if b_hundredths % 100 == 0 else float(f"{b_hundredths / 100:.2f}")
    N = p + S
    # Oracle: the smallest count whose share of the prompt reaches b %, then capped at S.
    smallest = next((B for B in range(N + 1) if 100 * B >= b * N), N)
    assert prompt_allowance(S, N, typed) == min(S, smallest)


def test_prompt_allowance_refuses_a_prompt_shorter_than_the_suffix():
    with pytest.raises(ValueError, match="prompt_len"):
        prompt_allowance(10, 9, 5)


def test_with_allowance_keeps_everything_else(llama):
    edit = random_edit(6, 4, 2, 50)
    request = AllocationRequest(llama, edit, 5, seed=3, options={"bonus": "off"})
    units = request.get_units()
    other = request.with_allowance(11)
    assert (other.allowance, other.seed, other.options, other.budget_pct) == (11, 3, {"bonus": "off"}, 5.0)
    assert other.units is units and request.allowance == 3


# ---------------------------------------------------------------------------------------------------------------------
# SUR's defaults are today's SUR: a frozen copy of the allocator at commit d1b47a3


def _frozen_unit_scores(token_scores, units, k=4):
    out = np.empty(len(units), dtype=np.float64)
    for i, u in enumerate(units):
        vals = np.asarray(token_scores[u.start : u.end], dtype=np.float64)
        top = np.sort(vals)[-k:] if len(vals) > k else vals
        out[i] = top.mean()
    return out


def _frozen_best_window(scores, width):
    r = np.asarray(scores, dtype=np.float64)
    peaks = np.exp(r - r.max())
    env = np.empty_like(peaks)
    prev = 0.0
    for t, value in enumerate(peaks):
        prev = max(value, float(np.exp(-1.0 / 16.0)) * prev)
        env[t] = prev
    return int(np.argmax(np.lib.stride_tricks.sliding_window_view(env, width).sum(axis=1)))


def _frozen_allocate_units(units, token_scores, unit_score, budget):
    starts = np.array([u.start for u in units], dtype=np.int64)
    ranked = np.lexsort((starts, -np.round(np.asarray(unit_score, dtype=np.float64), 5)))
    chosen, remaining = [], budget
    for idx in ranked:
        if remaining == 0:
            break
        u = units[idx]
        if len(u) <= remaining:
            chosen.append(np.arange(u.start, u.end))
            remaining -= len(u)
        else:
            off = _frozen_best_window(token_scores[u.start : u.end], remaining)
            chosen.append(np.arange(u.start + off, u.start + off + remaining))
            remaining = 0
    return (np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)).astype(np.int64)


def _frozen_sur(request, idf=False):
    if request.allowance == 0:
        return np.zeros(0, dtype=np.int64)
    weights = context_idf_weights(request.edit) if idf else None
    scores = sur_token_scores(request, weights)
    units = request.get_units()
    return _frozen_allocate_units(units, scores, _frozen_unit_scores(scores, units), request.allowance)


@st.composite
def _partitions(draw, S):
    """A random partition of [0, S) into units (lengths 1..40)."""
    lengths, left = [], S
    while left:
        n = draw(st.integers(1, min(40, left)))
        lengths.append(n)
        left -= n
    return _units(lengths)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    S=st.integers(0, 300), b=st.floats(0, 100, allow_nan=False), seed=st.integers(0, 2**16),
    q=st.lists(st.integers(0, 95), min_size=1, max_size=8), own_units=st.booleans(), data=st.data(),
)
def test_default_sur_and_sur_idf_equal_the_frozen_sur(llama32, S, b, seed, q, own_units, data):
    g = torch.Generator().manual_seed(seed)
    edit = token_edit(torch.randint(0, 96, (6 + 3 + S,), generator=g), 6, 3, q)
    units = data.draw(_partitions(S)) if own_units and S else None
    defaults = "SUR[aggregation=top4,partial_unit=forward,allowance_base=suffix,bonus=paper]"
    with fractions_expected():
        for name, idf in (("SUR", False), (defaults, False), ("SUR-IDF", True), ("SUR[bonus=idf]", True)):
            request = AllocationRequest(llama32, edit, b, units=units)
            expected = _frozen_sur(request, idf=idf)
            assert allocate(name, request).support.positions.tolist() == expected.tolist(), name


# ---------------------------------------------------------------------------------------------------------------------
# SUR's variants on hand-made cases (controlled embeddings: exact token scores)

QUERY, FILLER, NEAR = 40, 1, 2


@pytest.fixture(scope="module")
def controlled():
    """Embedding rows are orthonormal basis vectors (token t -> e_{t mod 48}), except token 2, which has cosine 0.3
    with the query token 40. SUR's token score is then 1.25 for token 40 (cos 1 + bonus), 0.3 for token 2 and 0 for
    every other token below 48."""
    lm = make_tiny_model("llama")
    with torch.no_grad():
        E = lm.model.get_input_embeddings().weight
        E.zero_()
        E[torch.arange(96), torch.arange(96) % 48] = 1.0
        E[NEAR] = 0.0
        E[NEAR, QUERY] = 0.3
        E[NEAR, NEAR] = math.sqrt(1 - 0.09)
    return lm


# Suffix of 30 in three units of 10: A = [0, 10) holds the query token at 3 (scores 0,0,0,1.25,0,...: top-4 mean
# 0.3125, mean 0.125); B = [10, 20) is all token 2 (every score 0.3: top-4 mean = mean = 0.3); C = [20, 30) scores 0.
# The prefix is 20 query tokens, so the IDF weight of token 40 is log(51/21)/log(51) and A's IDF top-4 mean is
# (1 + 0.25 w) / 4 = 0.264 < 0.3.
HAND_SUFFIX = [FILLER] * 3 + [QUERY] + [FILLER] * 6 + [NEAR] * 10 + [FILLER] * 10
HAND_UNITS = _units([10, 10, 10])


def _hand_request(lm, budget_pct=None, **kw):
    ids = [QUERY] * 20 + [7, 7] + HAND_SUFFIX
    edit = token_edit(ids, 20, 2, [QUERY])
    return AllocationRequest(lm, edit, budget_pct, units=list(HAND_UNITS), **kw)


@pytest.mark.parametrize(
    "name, count, expected",
    [
        ("SUR", 10, range(0, 10)),  # unit A (0.3125) first
        ("SUR[aggregation=mean]", 10, range(10, 20)),  # mean: B (0.3) beats A (0.125)
        ("SUR[bonus=off]", 10, range(10, 20)),  # no bonus: A's top-4 mean is 0.25 < 0.3
        ("SUR[bonus=idf]", 10, range(10, 20)),  # IDF: A's top-4 mean is 0.264 < 0.3
        ("SUR-IDF", 10, range(10, 20)),
        ("SUR", 4, range(3, 7)),  # A does not fit: forward-envelope window from the peak at 3 (Eq. 8)
        ("SUR[partial_unit=prefix]", 4, range(0, 4)),  # A does not fit: its first 4 tokens
        ("SUR", 13, [*range(0, 10), 10, 11, 12]),  # A whole, then B's flat envelope: its earliest window
        ("SUR[aggregation=mean]", 13, [*range(10, 20), 3, 4, 5]),  # B whole, then A's window from its peak
        ("SUR[aggregation=mean,partial_unit=prefix]", 13, [*range(10, 20), 0, 1, 2]),
    ],
)
def test_sur_variants_on_a_hand_made_case(controlled, name, count, expected):
    sel = allocate(name, _hand_request(controlled, allowance=count))
    assert sel.support.positions.tolist() == sorted(expected)


def test_hand_case_token_and_unit_scores(controlled):
    d = allocate("SUR", _hand_request(controlled, allowance=10)).diagnostics
    np.testing.assert_allclose(d["token_scores"][:4], [0, 0, 0, 1.25], atol=1e-7)
    np.testing.assert_allclose(d["unit_scores"], [0.3125, 0.3, 0.0], atol=1e-7)
    m = allocate("SUR[aggregation=mean]", _hand_request(controlled, allowance=10)).diagnostics
    np.testing.assert_allclose(m["unit_scores"], [0.125, 0.3, 0.0], atol=1e-7)
    w = math.log(51 / 21) / math.log(51)
    i = allocate("SUR-IDF", _hand_request(controlled, allowance=10)).diagnostics
    np.testing.assert_allclose(i["unit_scores"], [(1 + 0.25 * w) / 4, 0.3, 0.0], atol=1e-7)
    assert i["options"] == {"aggregation": "top4", "partial_unit": "forward", "bonus": "idf", "allowance_base": "suffix"}


def test_prompt_allowance_variant_on_the_hand_case(controlled):
    # p = 20, S = 30: 10 % is 3 positions of the suffix, 5 of the whole prompt (50 tokens).
    assert allocate("SUR", _hand_request(controlled, 10)).support.positions.tolist() == [3, 4, 5]
    prompt = allocate("SUR[allowance_base=prompt]", _hand_request(controlled, 10))
    assert prompt.support.positions.tolist() == [3, 4, 5, 6, 7]
    # The paper's second 9.3 arm: mean aggregation, prefix partial unit, whole-prompt allowance.
    arm = allocate("SUR[aggregation=mean,partial_unit=prefix,allowance_base=prompt]", _hand_request(controlled, 10))
    assert arm.support.positions.tolist() == [10, 11, 12, 13, 14]


def test_dense_tokens_and_the_single_window_read_the_bonus_option(controlled):
    # With the bonus off the query token scores 1.0 and token 2 scores 0.3: the top 11 are token 3 and unit B.
    dense = allocate("Dense tokens[bonus=off]", _hand_request(controlled, allowance=11))
    assert dense.support.positions.tolist() == [3, *range(10, 20)]
    np.testing.assert_allclose(dense.diagnostics["token_scores"][3], 1.0, atol=1e-7)
    window = allocate("Max-relevance contiguous[bonus=off]", _hand_request(controlled, allowance=2))
    assert window.support.positions.tolist() == [2, 3]  # 0 + 1.0 ties 1.0 + 0 (earliest wins) and beats 0.3 + 0.3


# ---------------------------------------------------------------------------------------------------------------------
# Matched-token protocol (Table 14)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_token_level_allocator_selects_exactly_surs_count(llama, seed):
    edit = random_edit(seed, 60 + 10 * seed, 4, 45 + 7 * seed)
    prepared = prepare(llama, edit)
    # Whole-prompt allowance: SUR's count is not Eq. 3's suffix allowance, so matching is not automatic.
    request = AllocationRequest(
        llama, edit, 5, shift_cache=prepared.shift_cache, seed=seed, allowance_base="prompt",
        options={"dirty_cache": prepared.dirty_cache},
    )
    out = matched_token_selections(request, "SUR", TOKEN_LEVEL_ALLOCATORS)
    n = out["SUR"].support.size
    assert n == prompt_allowance(edit.suffix_len, edit.edited_len, 5) != allowance(edit.suffix_len, 5)
    assert list(out) == ["SUR", *TOKEN_LEVEL_ALLOCATORS]
    for name in TOKEN_LEVEL_ALLOCATORS:
        assert out[name].support.size == n, name


def test_matched_tokens_with_a_variant_region_and_refusals(llama):
    edit = random_edit(9, 40, 3, 60)
    request = AllocationRequest(llama, edit, 5)
    out = matched_token_selections(request, "SUR[allowance_base=prompt]", ["Dense tokens", "Dense tokens[bonus=off]"])
    assert {k: v.support.size for k, v in out.items()} == {
        "SUR[allowance_base=prompt]": 5, "Dense tokens": 5, "Dense tokens[bonus=off]": 5,
    }
    with pytest.raises(ValueError, match="unknown allocator"):
        matched_token_selections(request, "SUR", ["Dense tokens", "Nope"])
    with pytest.raises(ValueError, match="also in token_level"):
        matched_token_selections(request, "SUR", ["SUR"])


# ---------------------------------------------------------------------------------------------------------------------
# SUR's whole-unit stopping point: the matched count of Table 14 (issue 40)


def test_whole_unit_count_admits_ranked_units_whole_until_b_is_reached():
    units = _units([5, 3, 8, 4])
    scores = np.array([0.1, 0.9, 0.5, 0.9])  # rank: unit 1 (tie with 3, earlier), unit 3, unit 2, unit 0
    expected = {0: 0, 1: 3, 3: 3, 4: 7, 7: 7, 8: 15, 15: 15, 16: 20, 20: 20}
    assert {b: whole_unit_count(units, scores, b) for b in expected} == expected
    for bad in (-1, 21, 2.5):
        with pytest.raises(ValueError, match="budget"):
            whole_unit_count(units, scores, bad)
    with pytest.raises(ValueError, match="unit_score"):
        whole_unit_count(units, scores[:3], 4)


@pytest.mark.parametrize("region", ["SUR", "SUR-IDF", "SUR[aggregation=mean]", "SUR[allowance_base=prompt]"])
@pytest.mark.parametrize("budget", [3, 10, 25])
def test_region_count_whole_units_is_surs_stopping_point_and_sur_selects_those_units(llama, region, budget):
    edit = random_edit(4, 50, 3, 90)
    units = _units([7, 13, 9, 21, 5, 11, 16, 8])  # 90 positions
    request = AllocationRequest(llama, edit, budget, units=units)
    base_b = allowance_for(region, request)
    n = region_count(region, request, "whole_units")
    assert region_count(region, request, "selected") == base_b
    # Oracle: SUR's own diagnostics at B (unit scores, tie rule), units added whole in rank order until B is covered.
    diag = allocate(region, request).diagnostics
    rank = np.lexsort(([u.start for u in units], -np.round(diag["unit_scores"], 5)))
    total, chosen = 0, []
    for i in rank:
        if total >= base_b:
            break
        total += len(units[i])
        chosen.append(int(i))
    assert n == total and base_b <= n < base_b + max(len(u) for u in units)
    whole = allocate(region, request.with_allowance(n))
    assert whole.diagnostics["partial"] is None and sorted(whole.diagnostics["admitted"]) == sorted(chosen)
    assert whole.support.positions.tolist() == sorted(p for i in chosen for p in range(units[i].start, units[i].end))
    out = matched_token_selections(request, region, ["Dense tokens", "Dense tokens[bonus=off]"], count="whole_units")
    assert {k: v.support.size for k, v in out.items()} == dict.fromkeys(out, n)


def test_region_count_refuses_a_non_sur_region_and_an_unknown_rule(llama):
    request = AllocationRequest(llama, random_edit(2, 30, 3, 40), 5)
    with pytest.raises(ValueError, match="SUR variant"):
        region_count("Fixed blocks", request, "whole_units")
    with pytest.raises(ValueError, match="count"):
        region_count("SUR", request, "all")
    with pytest.raises(ValueError, match="count"):
        matched_token_selections(request, "SUR", ["Dense tokens"], count="all")
    assert region_count("Fixed blocks", request, "selected") == allowance(40, 5)
    assert region_count("SUR", AllocationRequest(llama, random_edit(2, 30, 3, 40), 0), "whole_units") == 0


# ---------------------------------------------------------------------------------------------------------------------
# Fixed blocks against a brute-force oracle


@settings(max_examples=100, deadline=None)
@given(S=st.integers(1, 300), data=st.data())
def test_fixed_blocks_are_equal_contiguous_blocks(S, data):
    n = data.draw(st.integers(1, S))
    blocks = controls.fixed_blocks(S, n)
    sizes = [len(b) for b in blocks]
    assert len(blocks) == n and sum(sizes) == S and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert [b.start for b in blocks] == [sum(sizes[:i]) for i in range(n)]


def test_fixed_blocks_refuse_a_bad_count():
    assert controls.fixed_blocks(0, 3) == []
    with pytest.raises(ValueError, match="num_blocks"):
        controls.fixed_blocks(5, 6)


def _envelope(values):
    """Eq. 8 written out in Python floats."""
    top, prev, out = max(values), 0.0, []
    for r in values:
        prev = max(math.exp(r - top), math.exp(-1 / 16) * prev)
        out.append(prev)
    return out


def _regions_oracle(regions, scores, budget, aggregation, partial_unit):
    """Brute force over the region allocation: rank with Python's sort on (-rounded score, start), admit whole regions,
    then list the acceptable starts of the partial window: every start whose exactly rounded envelope sum (fsum) is
    within 1e-9 of the maximum and of every earlier start's (float summation order may break a real tie either way).

    Returns ``(whole positions, partial region or None, width, acceptable starts)``."""
    def score(r):
        vals = sorted((float(scores[i]) for i in range(r.start, r.end)), reverse=True)
        top = vals[:4] if aggregation == "top4" else vals
        return float(np.round(sum(top) / len(top), 5))

    ranked = sorted(regions, key=lambda r: (-score(r), r.start))
    whole, left = [], budget
    for r in ranked:
        if left == 0:
            break
        if len(r) <= left:
            whole += list(range(r.start, r.end))
            left -= len(r)
            continue
        if partial_unit == "prefix":
            return whole, r, left, {r.start}
        env = _envelope([float(scores[i]) for i in range(r.start, r.end)])
        sums = [math.fsum(env[s : s + left]) for s in range(len(r) - left + 1)]
        best = max(sums)
        ok = {r.start + s for s, v in enumerate(sums) if v >= best - 1e-9 and all(u < v + 1e-9 for u in sums[:s])}
        return whole, r, left, ok
    return whole, None, 0, set()


def _check_against_regions_oracle(positions, regions, scores, budget, aggregation, partial_unit):
    whole, part, width, ok = _regions_oracle(regions, scores, budget, aggregation, partial_unit)
    got = positions.tolist()
    assert len(got) == budget
    rest = sorted(set(got) - set(whole))
    assert set(whole) <= set(got)
    if part is None:
        assert rest == []
    else:
        assert len(rest) == width and rest == list(range(rest[0], rest[0] + width)) and rest[0] in ok


@settings(max_examples=150, deadline=None)
@given(
    S=st.integers(1, 80),
    eighths=st.lists(st.integers(-8, 10), min_size=80, max_size=80),
    aggregation=st.sampled_from(["top4", "mean"]),
    partial_unit=st.sampled_from(["forward", "prefix"]),
    data=st.data(),
)
def test_block_allocation_matches_the_brute_force_oracle(S, eighths, aggregation, partial_unit, data):
    scores = np.array(eighths[:S], dtype=np.float64) / 8  # exact in binary: unit means compare exactly
    n = data.draw(st.integers(1, S))
    B = data.draw(st.integers(0, S))
    blocks = controls.fixed_blocks(S, n)
    positions, _ = allocate_regions(blocks, scores, B, aggregation=aggregation, partial_unit=partial_unit)
    _check_against_regions_oracle(positions, blocks, scores, B, aggregation, partial_unit)


@pytest.mark.parametrize("option", ["units", 16, 7])
def test_fixed_blocks_allocator_uses_equal_blocks_and_the_oracle(llama, option):
    edit = random_edit(11, 9, 3, 301)
    request = AllocationRequest(llama, edit, 10, options={"block_len": option, "partial_unit": "forward"})
    sel = allocate("Fixed blocks", request)
    d = sel.diagnostics
    S = edit.suffix_len
    n = len(request.get_units()) if option == "units" else -(-S // option)
    assert d["num_blocks"] == n and d["units"] == controls.fixed_blocks(S, n)
    if option != "units":
        assert all(len(b) <= option for b in d["units"])
    _check_against_regions_oracle(sel.support.positions, d["units"], d["token_scores"], 31, "top4", "forward")


# ---------------------------------------------------------------------------------------------------------------------
# Multiple local windows against a brute-force oracle


def _windows_oracle(scores, budget, k):
    """Slow restatement of :func:`controls.local_windows`: anchor = best unchosen score (earliest first); among every
    width-w window inside the anchor's free run that contains the anchor, the one whose centre offset (w - 1) // 2 is
    nearest the anchor; a run shorter than w is taken whole and the shortfall moves to the next window."""
    S = len(scores)
    if budget == 0:
        return []
    k = min(k, budget)
    widths = [budget // k + (1 if i < budget % k else 0) for i in range(k)]
    chosen: set[int] = set()
    carry, j = 0, 0
    while len(chosen) < budget:
        width = (widths[j] if j < k else 0) + carry
        j += 1
        free = [i for i in range(S) if i not in chosen]
        anchor = max(free, key=lambda i: (scores[i], -i))
        lo = anchor
        while lo - 1 >= 0 and lo - 1 not in chosen:
            lo -= 1
        hi = anchor
        while hi + 1 < S and hi + 1 not in chosen:
            hi += 1
        w = min(width, hi - lo + 1)
        candidates = [s for s in range(lo, hi - w + 2) if s <= anchor < s + w]
        start = min(candidates, key=lambda s: abs(s + (w - 1) // 2 - anchor))
        chosen |= set(range(start, start + w))
        carry = width - w
    return sorted(chosen)


@settings(max_examples=200, deadline=None)
@given(scores=st.lists(st.integers(-3, 3), min_size=1, max_size=60), data=st.data())
def test_local_windows_match_the_brute_force_oracle(scores, data):
    S = len(scores)
    B, k = data.draw(st.integers(0, S)), data.draw(st.integers(1, 8))
    arr = np.array(scores, dtype=np.float64)
    positions, windows = controls.local_windows(arr, B, k)
    assert positions.tolist() == _windows_oracle(arr.tolist(), B, k)
    assert len(positions) == B == sum(e - s for s, e in windows)
    if B:
        assert windows[0][0] <= int(np.argmax(arr)) < windows[0][1]  # the first window holds the best token


def test_local_windows_hand_cases():
    # One window of 4 around the peak at 2: anchor at offset (4 - 1) // 2 = 1 -> [1, 5).
    assert controls.local_windows(np.array([0, 0, 9, 0, 0, 0, 0.0]), 4, 1)[1] == [(1, 5)]
    # Near the end the window is shifted inward.
    assert controls.local_windows(np.array([0, 0, 0, 0, 0, 0, 9.0]), 3, 1)[1] == [(4, 7)]
    # Widths 3 + 3. The first window is [2, 5) around the 9; the second anchor (the 8 at 5) has a free run [5, 7) of
    # only 2: it is taken whole and the shortfall of 1 becomes a third window, at the best free token (earliest 0).
    pos, windows = controls.local_windows(np.array([0, 0, 0, 9, 0, 8, 0.0]), 6, 2)
    assert windows == [(2, 5), (5, 7), (0, 1)] and pos.tolist() == [0, 2, 3, 4, 5, 6]
    # Even width: the anchor sits at offset (w - 1) // 2 = 0, so the window reaches forward.
    assert controls.local_windows(np.array([0, 0, 0, 9, 0, 8, 0.0]), 4, 2)[1] == [(3, 5), (5, 7)]
    with pytest.raises(ValueError, match="budget"):
        controls.local_windows(np.zeros(3), 4, 1)
    with pytest.raises(ValueError, match="num_windows"):
        controls.local_windows(np.zeros(3), 2, 0)


def test_multiple_local_windows_matches_surs_interval_count_by_default(llama):
    for seed in range(4):
        edit = random_edit(20 + seed, 8, 3, 400, query=9)
        request = AllocationRequest(llama, edit, 10, units=_units([25] * 16))  # many units: several SUR intervals
        sel = allocate("Multiple local windows", request)
        k = allocate("SUR", request).support.num_intervals
        d = sel.diagnostics
        assert d["num_windows"] == k
        assert sel.support.positions.tolist() == _windows_oracle(d["token_scores"].tolist(), 40, k)
        three = allocate("Multiple local windows[windows=3]", request)
        assert three.diagnostics["num_windows"] == 3
        assert three.support.positions.tolist() == _windows_oracle(d["token_scores"].tolist(), 40, 3)


def test_one_region_check_serves_the_count_and_the_studys_arms(llama):
    """:func:`sur_lab.allocators.check_region` is the one check: ``region_count`` and the NIAH matched arms refuse
    the same regions and rules with its words, before any scoring."""
    from sur_lab.allocators import check_region
    from sur_lab.studies import niah

    request = AllocationRequest(llama, random_edit(2, 30, 3, 40), 5)
    for region, count in (("Fixed blocks", "whole_units"), ("SUR", "all"), ("Nope", "selected")):
        with pytest.raises(ValueError) as own:
            check_region(region, count)
        for call in (lambda: region_count(region, request, count), lambda: niah.MatchedRegion(region, 5, count),
                     lambda: niah.MatchedTokens("Dense tokens", region, 5, count)):
            with pytest.raises(ValueError) as other:
                call()
            assert str(other.value) == str(own.value), (region, count)
    check_region("SUR-IDF", "whole_units")
    check_region("Fixed blocks", "selected")
