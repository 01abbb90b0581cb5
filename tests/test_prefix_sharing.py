"""Exact prefix sharing inside a case (issue 37): with ``PreparedEdit.share_prefix`` Replay's suffix forward runs once
on the Dirty prefill's valid prefix and serves Replay, every allocator at B = S and Re-prefill.

On the float64 tiny models: a shared Re-prefill equals the independent rebuild from empty within float64 rounding
(``fp64_tol``: the two differ only in the shapes of the prefix's GEMMs), Replay and B = S are bitwise the unshared
Replay (the same operations on the same inputs), the suffix forward runs once, a cache without a Dirty prefill never
shares its Re-prefill, and ``run_case`` records with and without sharing agree (answers exactly, endpoints within the
rounding carried to float32 logits); the fingerprint says which ran and a timed case never shares.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import fp64_tol, make_tiny_model
from test_allocators import char_tokenizer
from test_batched_eval import _assert_same, _ulp_tol

import importlib
from sur_lab.answer import greedy_answer
from sur_lab.cache_ops import caches_equal, to_tensors
from sur_lab.edits import splice_replacement, token_edit
from sur_lab.repair import PreparedEdit, prepare, repair, shares_prefix
from sur_lab.sweeps import Case, run_case, run_sweep

repair_module = importlib.import_module("sur_lab.repair")  # the package attribute `repair` is the function


def _ids(n, seed, vocab=96):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _deletion():
    return token_edit(_ids(48, 1), 12, 7, _ids(5, 2))


def _replacement():
    original, p, d = splice_replacement(_ids(40, 3), 14, 21, _ids(4, 4))
    return dataclasses.replace(token_edit(original, p, d, _ids(5, 5)), inserted_len=4)


EDITS = {"deletion": _deletion, "replacement": _replacement}


def _max_diff(a, b):
    return max(max((k - k2).abs().max().item(), (v - v2).abs().max().item())
               for (k, v), (k2, v2) in zip(to_tensors(a), to_tensors(b)))


def _counting_replay(monkeypatch):
    calls = []
    original = repair_module.replay

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(repair_module, "replay", counted)
    return calls


@pytest.mark.parametrize("kind", list(EDITS))
def test_shared_references_equal_the_independent_ones(tiny_lm, kind, monkeypatch):
    lm, edit = tiny_lm, EDITS[kind]()
    alone = prepare(lm, edit)
    independent = {m: repair(lm, alone, m).cache for m in ("Replay", "Re-prefill")}
    full = repair(lm, alone, "SUR", 100).cache
    calls = _counting_replay(monkeypatch)
    shared = prepare(lm, edit)
    shared.share_prefix = True
    assert shares_prefix(shared) and not shares_prefix(alone)
    results = {m: repair(lm, shared, m) for m in ("Re-prefill", "Replay")}
    at_full = repair(lm, shared, "SUR", 100)
    assert len(calls) == 1  # one suffix forward served Re-prefill, Replay and B = S
    # Replay and B = S: the same computation as without sharing, so the same bits.
    assert caches_equal(results["Replay"].cache, independent["Replay"])
    assert caches_equal(at_full.cache, full)
    # Re-prefill: equal to the rebuild from empty in exact arithmetic; in float64 within rounding, and not bitwise
    # the same object (each result is a clone the caller owns).
    reprefilled = results["Re-prefill"].cache
    assert _max_diff(reprefilled, independent["Re-prefill"]) <= fp64_tol(independent["Re-prefill"])
    assert caches_equal(reprefilled, results["Replay"].cache)
    assert reprefilled.layers[0].keys.data_ptr() != results["Replay"].cache.layers[0].keys.data_ptr()
    # Timings: Replay's suffix forward is measured; a shared Re-prefill ran no rebuild.
    assert math.isnan(results["Re-prefill"].timings_ms["refresh"])
    assert results["Replay"].timings_ms["refresh"] > 0
    assert at_full.timings_ms["refresh"] == results["Replay"].timings_ms["refresh"]
    assert results["Re-prefill"].allowance == edit.suffix_len


def test_a_cache_without_a_dirty_prefill_never_shares_its_reprefill(tiny_lm, monkeypatch):
    """A composed stale cache's prefix rows need not be a prefill's: Re-prefill is rebuilt from empty."""
    lm, edit = tiny_lm, _deletion()
    full = prepare(lm, edit)
    composed = PreparedEdit(edit, None, full.shift_cache, 0.0, 0.0, share_prefix=True)
    calls = _counting_replay(monkeypatch)
    result = repair(lm, composed, "Re-prefill")
    assert not shares_prefix(composed) and not calls and math.isfinite(result.timings_ms["refresh"])
    assert caches_equal(result.cache, repair(lm, full, "Re-prefill").cache)


def test_the_shared_replay_is_not_modified_by_its_users(tiny_lm):
    lm, edit = tiny_lm, _deletion()
    prepared = prepare(lm, edit)
    prepared.share_prefix = True
    first = repair(lm, prepared, "Replay").cache
    reference = [(k.clone(), v.clone()) for k, v in to_tensors(first)]
    for k, v in to_tensors(first):
        k.add_(1.0)
        v.zero_()
    again = repair(lm, prepared, "Replay").cache
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(to_tensors(again), reference))


def _case(kind="deletion"):
    return Case(f"share-{kind}", EDITS[kind](), gold=("7",), answer_ids=(3, 5))


METHODS = ("Dirty", "Shift", "Replay", "Re-prefill", "SUR", "Dense tokens")


@pytest.fixture(scope="module")
def text_lm():
    """A tiny float64 Qwen3 with a character tokenizer (answers decode to text)."""
    return dataclasses.replace(make_tiny_model("qwen3"), tokenizer=char_tokenizer())


@pytest.mark.parametrize("kind", list(EDITS))
def test_run_case_records_agree_with_and_without_sharing(text_lm, kind):
    lm = text_lm
    case = _case(kind)
    kw = dict(max_new_tokens=4, eval_batch=16)
    shared = run_case(lm, case, METHODS, [5, 100], share_prefix=True, **kw)
    alone = run_case(lm, case, METHODS, [5, 100], share_prefix=False, **kw)
    assert [r.key for r in shared] == [r.key for r in alone]
    assert all(r.shared_prefix for r in shared) and not any(r.shared_prefix for r in alone)
    # float64 states differing by float64 rounding give float32 logits within one float32 ulp of their magnitude;
    # _assert_same carries that to each endpoint (TV, NLL, margins), with a margin of 4 for the other methods' logits.
    prepared = prepare(lm, case.edit)
    logits = greedy_answer(lm, repair(lm, prepared, "Re-prefill").cache, case.edit.query_ids,
                           max_new_tokens=1).first_token_logits
    for a, b in zip(alone, shared):
        _assert_same(a, b, tol_logit=4 * _ulp_tol(logits))  # shared_prefix and bitwise logit fields left out
        assert a.answer == b.answer
    by = {r.method: r for r in shared if math.isnan(r.budget_pct)}
    assert math.isnan(by["Re-prefill"].refresh_ms) and by["Replay"].refresh_ms > 0
    assert all(np.isfinite(r.refresh_ms) for r in alone)


def test_a_timed_case_never_shares(text_lm):
    case = _case()
    records = run_case(text_lm, case, ("Shift", "Re-prefill"), [], max_new_tokens=2, timed=True, share_prefix=True)
    assert not any(r.shared_prefix for r in records)
    reprefill = next(r for r in records if r.method == "Re-prefill")
    assert np.isfinite(reprefill.refresh_ms) and reprefill.timed


def test_sharing_is_part_of_the_fingerprint(text_lm, tmp_path):
    case = _case()
    run_sweep(text_lm, [case], ("Shift", "Re-prefill"), [], tmp_path, max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match="shared_prefix"):
        run_sweep(text_lm, [case], ("Shift", "Re-prefill"), [], tmp_path, max_new_tokens=2, progress=False,
                  share_prefix=False)
