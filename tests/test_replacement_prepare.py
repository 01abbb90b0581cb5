"""The honest replacement prepare (issue 26): a replacement's Dirty cache is the context an agent held before it (the
old value in place, the new one absent), its Shift drops the old span, prefills the new text's rows after the prefix
and re-rotates the suffix; the session builds the same cache; at a 100 % budget every allocator equals Re-prefill of
the new prompt; Erratum through the one dispatcher extends the pre-edit cache. Float64 tiny models."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import fp64_tol, hf_prefill

from sur_lab import EditSession
from sur_lab.answer import check_cache_rows
from sur_lab.cache_ops import (
    cache_length,
    caches_equal,
    clone_cache,
    rerotate_keys,
    to_tensors,
)
from sur_lab.edits import EditedContext, splice_replacement, token_edit
from sur_lab.executors import dirty_rows, pre_edit_ids, shift_inplace
from sur_lab.repair import prepare, recover, repair
from sur_lab.sweeps import Case, run_case


def _ids(n, seed, vocab=96):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _replacement(n=40, start=14, end=21, m=4, seed=0):
    """``before ⊕ old ⊕ after`` of n tokens, rows [start, end) replaced by m new tokens, as one edit."""
    before_edit = _ids(n, seed)
    new = _ids(m, seed + 1)
    original, p, d = splice_replacement(before_edit, start, end, new)
    edit = dataclasses.replace(token_edit(original, p, d, _ids(5, seed + 2)), inserted_len=m)
    return edit, before_edit, new


def _diff(a, b, rows=slice(None)):
    return max(max((k[:, :, rows] - k2[:, :, rows]).abs().max().item(),
                   (v[:, :, rows] - v2[:, :, rows]).abs().max().item()) for (k, v), (k2, v2) in zip(a, b))


def _tol(layers):
    return fp64_tol(*[t for kv in layers for t in kv])


# A replacement in the middle, at the very start (empty kept prefix), with an empty suffix, longer and shorter than the
# old span.
CASES = [{"start": 14, "end": 21, "m": 4}, {"start": 0, "end": 6, "m": 3}, {"start": 30, "end": 40, "m": 2},
         {"start": 10, "end": 12, "m": 7}]


@pytest.mark.parametrize("kw", CASES)
def test_replacement_dirty_is_a_prefill_of_the_context_before_the_edit(tiny_lm, kw):
    edit, before_edit, _ = _replacement(**kw)
    assert torch.equal(pre_edit_ids(edit), before_edit)
    prepared = prepare(tiny_lm, edit)
    assert cache_length(prepared.dirty_cache) == dirty_rows(edit) == before_edit.numel()
    oracle, _ = hf_prefill(tiny_lm, before_edit)
    assert _diff(to_tensors(prepared.dirty_cache), oracle) <= _tol(oracle)
    dirty = repair(tiny_lm, prepared, "Dirty").cache
    assert caches_equal(dirty, prepared.dirty_cache)
    assert check_cache_rows(dirty, edit) == before_edit.numel()


@pytest.mark.parametrize("kw", CASES)
def test_replacement_shift_inserts_the_new_rows_and_rerotates_the_pre_edit_suffix(tiny_lm, kw):
    edit, _, _ = _replacement(**kw)
    p, d, m, S = edit.prefix_len, edit.deleted_len, edit.inserted_len, edit.suffix_len
    prepared = prepare(tiny_lm, edit)
    shift = to_tensors(prepared.shift_cache)
    pre = to_tensors(prepared.dirty_cache)
    assert cache_length(prepared.shift_cache) == p + S
    # Prefix and inserted rows: a clean prefill of the edited prompt's first p tokens (they are causal).
    clean, _ = hf_prefill(tiny_lm, edit.edited_ids)
    assert _diff(shift, clean, slice(0, p)) <= _tol(clean)
    # The kept prefix rows are the pre-edit rows themselves.
    for (k, v), (k0, v0) in zip(shift, pre):
        assert torch.equal(k[:, :, : p - m], k0[:, :, : p - m]) and torch.equal(v[:, :, : p - m], v0[:, :, : p - m])
    # Suffix rows: the pre-edit rows (which saw the old value only), values copied, keys moved by m - d positions.
    a = p - m
    for (k, v), (k0, v0) in zip(shift, pre):
        assert torch.equal(v[:, :, p:], v0[:, :, a + d :])
        if S:
            back = rerotate_keys(k[:, :, p:], d - m, tiny_lm.inv_freq)
            assert (back - k0[:, :, a + d :]).abs().max().item() <= fp64_tol(k0)
    # ...and they are stale: the suffix of a clean prefill differs (the old value is gone from its context).
    if S:
        assert _diff(shift, clean, slice(p, p + S)) > 100 * _tol(clean)


@pytest.mark.parametrize("kw", CASES)
def test_the_session_replace_builds_the_same_shift_cache(tiny_lm, kw):
    edit, before_edit, new = _replacement(**kw)
    prepared = prepare(tiny_lm, edit)
    session = EditSession(tiny_lm, method="Shift")
    session.append(before_edit)
    session.replace(kw["start"], kw["end"], new)
    assert torch.equal(session.tokens, edit.edited_ids)
    ref = to_tensors(prepared.shift_cache)
    assert _diff(to_tensors(session.cache), ref) <= _tol(ref)


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("method", ["SUR", "Dense tokens", "Replay"])
def test_a_full_budget_replacement_equals_reprefill_of_the_new_prompt(tiny_lm, kw, method):
    edit, _, _ = _replacement(**kw)
    prepared = prepare(tiny_lm, edit)
    out = repair(tiny_lm, prepared, method, 100.0)
    oracle, _ = hf_prefill(tiny_lm, edit.edited_ids)
    assert cache_length(out.cache) == edit.edited_len
    assert _diff(to_tensors(out.cache), oracle) <= _tol(oracle)
    assert _diff(to_tensors(repair(tiny_lm, prepared, "Re-prefill").cache), oracle) <= _tol(oracle)


@pytest.mark.parametrize("kw", CASES[:2])
def test_recover_from_the_pre_edit_cache_matches_prepare_and_repair(tiny_lm, kw):
    edit, _, _ = _replacement(**kw)
    prepared = prepare(tiny_lm, edit)
    full = recover(tiny_lm, edit, prepared.dirty_cache, "SUR", 100.0, executor="sequential")
    oracle, _ = hf_prefill(tiny_lm, edit.edited_ids)
    assert _diff(to_tensors(full.cache), oracle) <= _tol(oracle)
    kept = clone_cache(prepared.dirty_cache)
    part = recover(tiny_lm, edit, prepared.dirty_cache, "Dense tokens", 40.0, executor="sequential", inplace=True)
    ref = repair(tiny_lm, prepare(tiny_lm, edit), "Dense tokens", 40.0)
    assert np.array_equal(part.support.positions, ref.support.positions)
    assert _diff(to_tensors(part.cache), to_tensors(ref.cache)) <= _tol(to_tensors(ref.cache))
    assert caches_equal(prepared.dirty_cache, kept)  # a replacement's Shift builds a new cache: the input is kept
    with pytest.raises(ValueError, match="replacement"):
        shift_inplace(tiny_lm, prepared.dirty_cache, edit)
    with pytest.raises(ValueError, match="dirty_cache has"):
        recover(tiny_lm, edit, prepare(tiny_lm, dataclasses.replace(edit, inserted_len=0)).dirty_cache, "SUR", 5.0)


def test_erratum_is_a_reference_operator_extending_the_pre_edit_cache(tiny_lm):
    edit, before_edit, _ = _replacement()
    note = _ids(6, 9)
    prepared = prepare(tiny_lm, edit)
    out = repair(tiny_lm, prepared, "Erratum", options={"erratum_note_ids": note.tolist()})
    oracle, _ = hf_prefill(tiny_lm, torch.cat((before_edit, note)))
    assert cache_length(out.cache) == before_edit.numel() + 6
    assert _diff(to_tensors(out.cache), oracle) <= _tol(oracle)
    assert (out.note_tokens, out.note_template, out.allowance) == (6, "ids", 0) and np.isnan(out.budget_pct)
    assert check_cache_rows(out.cache, edit, note_tokens=6) == before_edit.numel() + 6
    with pytest.raises(ValueError, match="rows"):
        check_cache_rows(out.cache, edit)
    with pytest.raises(ValueError, match="edit has no text"):
        repair(tiny_lm, prepared, "Erratum")  # a token-level edit has no note text
    with pytest.raises(ValueError, match="erratum_template='nope'"):
        repair(tiny_lm, prepared, "Erratum", options={"erratum_template": "nope"})


def test_run_case_records_erratum_with_its_note(tiny_lm):
    edit, before_edit, _ = _replacement()
    note = _ids(5, 11).tolist()
    case = Case("r0", edit, meta={"gold_token": 7})
    records = run_case(tiny_lm, case, ["Dirty", "Shift", "Re-prefill", "Erratum", "SUR"], [50], max_new_tokens=2,
                       options={"erratum_note_ids": note})
    by = {r.method: r for r in records}
    assert by["Erratum"].cache_len == before_edit.numel() + 5 and by["Erratum"].note_tokens == 5
    assert by["Erratum"].note_template == "ids" and by["SUR"].note_tokens == 0 and by["SUR"].note_template == ""
    assert by["Dirty"].cache_len == before_edit.numel() and by["Shift"].cache_len == edit.edited_len
    # gold_margin: the first-token margin of the declared gold token, from each record's own logits.
    assert all(np.isfinite(r.gold_margin) for r in records)
    plain = run_case(tiny_lm, Case("r1", edit), ["Shift", "Re-prefill"], [], max_new_tokens=1)
    assert all(np.isnan(r.gold_margin) for r in plain)


def test_inserted_len_is_checked_and_fingerprinted():
    edit = token_edit(_ids(20, 1), 6, 3, _ids(3, 2))
    with pytest.raises(ValueError, match="inserted_len=7 must lie in"):
        EditedContext(edit.original_ids, edit.query_ids, 6, 3, inserted_len=7)
    with pytest.raises(TypeError, match="inserted_len"):
        EditedContext(edit.original_ids, edit.query_ids, 6, 3, inserted_len=1.0)
    assert Case("a", edit).fingerprint() != Case("a", dataclasses.replace(edit, inserted_len=2)).fingerprint()


def test_session_erratum_appends_the_dispatchers_note(tiny_lm):
    edit, before_edit, new = _replacement()
    note = _ids(6, 9)
    session = EditSession(tiny_lm, method="Shift")
    session.append(before_edit)
    record = session.replace(14, 21, new, method="Erratum", options={"erratum_note_ids": note.tolist()})
    assert torch.equal(session.tokens, torch.cat((before_edit, note)))  # the old rows stay, the note follows
    assert (record.method, record.allowance, record.forwarded_tokens, record.num_tokens) == ("Erratum", 0, 6, 46)
    assert np.isnan(record.budget_pct)
    oracle = repair(tiny_lm, prepare(tiny_lm, edit), "Erratum", options={"erratum_note_ids": note.tolist()}).cache
    ref = to_tensors(oracle)
    assert _diff(to_tensors(session.cache), ref) <= _tol(ref)
    with pytest.raises(ValueError, match="erratum_note_ids"):
        session.delete(0, 3, method="Erratum")  # a session without text has no note to write
    with pytest.raises(ValueError, match="sync"):
        session.sync(session.tokens, method="Erratum")
