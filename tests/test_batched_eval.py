"""Batched evaluation of a case (issue 23): AnswerBatch against the per-record decoder, and run_case at eval_batch 1, 3
and all giving the same records, for every method, with rows that stop at different steps; timing honesty.

Tolerances. The tiny models run in float64, but an Answer's first-token logits are float32 by contract, and the NLLs
are computed from those float32 logits (as continuation_nll does). Two float64 computations of one logit that differ
in shape (batch rows, padding) agree to ~1e-15 and round to the same float32 value or to neighbours one float32 ulp
apart, so logits are compared to one float32 ulp of their largest magnitude, and an NLL over T tokens to 2 T ulps
(log-softmax moves each log-probability by at most twice the largest logit change). Token ids and texts are exact.
The endpoints of issue 25 take the same bounds: a mean gold NLL and a gold margin move by at most twice the logit
change d, and a first-token JSD by at most 2.4 d (its gradient in either logit vector has L1 norm at most
(1 + 2 ln 2) / 2 < 1.2). The byte-level ones (``logits_identical``, ``logits_digest``) are compared only within one
batch shape, never across eval_batch.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import make_tiny_model
from transformers import DynamicCache

from sur_lab.allocators import ALLOCATORS
from sur_lab.analysis.endpoints import canonical_answer_ids, gold_margin, logits_digest
from sur_lab.answer import AnswerBatch, continuation_nll, greedy_answer, greedy_answers
from sur_lab.cache_ops import cache_length, from_tensors, to_tensors
from sur_lab.repair import REFERENCE_METHODS, prepare, repair
from sur_lab.studies.niah import build_niah_case, niah_scorer, parse_niah_answer
from sur_lab.sweeps import ANSWER_TIMING_FIELDS, Case, comparable_fields, run_case
from test_allocators import char_tokenizer
from test_niah import CORPUS

EPS32 = torch.finfo(torch.float32).eps
#: Every registered allocator except SpecCache-Adapted, whose signal loads the embedded auxiliary model (its repair
#: goes through the same dispatcher as the others).
ALLOCATOR_METHODS = tuple(sorted(m for m in ALLOCATORS if m != "SpecCache-Adapted"))
METHODS = (*REFERENCE_METHODS, *ALLOCATOR_METHODS)
BUDGETS = (5, 37)
MAX_NEW = 8


def _ulp_tol(*tensors) -> float:
    return float(EPS32 * max(float(t.abs().max()) for t in tensors))


def _with_eos(lm, token: int):
    """The same weights with ``token`` added to the EOS ids (a fresh model object; the fixture's stays unchanged)."""
    model = make_tiny_model("llama", seed=SEED).model
    eos = [*lm.eos_token_ids, token]
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos
    return dataclasses.replace(lm, model=model)


#: Model seed whose methods' answers differ (Dirty's departs from Re-prefill's after two tokens).
SEED = 1


@pytest.fixture(scope="module")
def lm():
    return dataclasses.replace(make_tiny_model("llama", seed=SEED), tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def case(lm):
    c = build_niah_case(lm.tokenizer, CORPUS, context_len=300, depths=(0.2, 0.6), delete=0, seed=0)
    # An explicit answer target of several tokens: NIAH's parser leaves the case without a derived one.
    answer = canonical_answer_ids(lm.tokenizer, "needle 42", "Answer:")
    assert len(answer) > 3
    return dataclasses.replace(c.sweep_case(), case_id="case/0", answer_ids=tuple(answer))


def _stops(answers, token: int) -> set:
    """(tokens generated, finished) of each answer if ``token`` were an EOS id too."""
    out = set()
    for a in answers:
        ids, done = list(a.token_ids), a.finished
        if token in ids:
            ids, done = ids[: ids.index(token)], True
        out.add((len(ids), done))
    return out


@pytest.fixture(scope="module")
def eos_lm(lm, case):
    """The tiny model with an extra EOS id chosen so that the methods' answers stop at different steps, some by EOS
    and some at ``MAX_NEW``."""
    prepared = prepare(lm, case.edit)
    caches = [repair(lm, prepared, m, 20).cache for m in ("Re-prefill", "Dirty", "Shift", "SUR", "Dense tokens")]
    answers = [greedy_answer(lm, c, case.edit.query_ids, max_new_tokens=MAX_NEW) for c in caches]
    candidates = []
    for token in sorted({t for a in answers for t in a.token_ids}):
        stops = _stops(answers, token)
        if min(n for n, _ in stops) >= 1 and {d for _, d in stops} == {True, False}:
            candidates.append((len(stops), token))
    assert candidates, "no token id stops the answers at different steps"
    return _with_eos(lm, max(candidates)[1])


def test_answer_batch_equals_the_per_record_decoder(eos_lm, case):
    lm = eos_lm
    prepared = prepare(lm, case.edit)
    caches = [repair(lm, prepared, m, 20).cache for m in ("Re-prefill", "Dirty", "Shift", "SUR", "Dense tokens")]
    lengths = {cache_length(c) for c in caches}
    assert len(lengths) == 2  # Dirty's N rows and everyone else's p + S: a padded batch
    singles = [greedy_answer(lm, c, case.edit.query_ids, max_new_tokens=MAX_NEW) for c in caches]
    assert len({len(a.token_ids) for a in singles}) >= 2 and any(a.finished for a in singles)
    target = list(singles[0].token_ids) or [5]
    nll = [continuation_nll(lm, c, case.edit, target) for c in caches]
    before = [[(k.clone(), v.clone()) for k, v in to_tensors(c)] for c in caches]
    for size in (1, 3, len(caches)):
        for start in range(0, len(caches), size):
            chunk = caches[start : start + size]
            batch = AnswerBatch(lm, chunk, case.edit.query_ids)
            answers = batch.decode(MAX_NEW)
            logprobs = batch.score(target)
            again = batch.decode(MAX_NEW)  # decode and score both restart from the state after the query
            for i, ans in enumerate(answers):
                ref = singles[start + i]
                assert ans.token_ids == ref.token_ids and ans.text == ref.text and ans.finished == ref.finished
                assert again[i].token_ids == ref.token_ids
                tol = _ulp_tol(ref.first_token_logits)
                torch.testing.assert_close(ans.first_token_logits, ref.first_token_logits, rtol=0, atol=tol)
                assert -logprobs[i].sum() == pytest.approx(nll[start + i], abs=2 * len(target) * tol)
                assert math.isnan(ans.timings_ms["answer"]) == (size > 1)
    # copy=True (the default) leaves the callers' caches unchanged
    for c, layers in zip(caches, before):
        for (k_now, v_now), (k, v) in zip(to_tensors(c), layers):
            assert torch.equal(k_now, k) and torch.equal(v_now, v)
    assert [a.token_ids for a in greedy_answers(lm, caches, case.edit.query_ids, max_new_tokens=MAX_NEW)] == [
        a.token_ids for a in singles]


def test_answer_batch_from_per_request_query_forwards(eos_lm, case):
    """AnswerBatch.queried continues the per-request query forwards (greedy_answer with one token, copy=False):
    every row's answer, stop and target NLL are the per-record decoder's, on a padded batch; the caches the caller
    keeps are unchanged with copy=True."""
    lm = eos_lm
    prepared = prepare(lm, case.edit)
    caches = [repair(lm, prepared, m, 20).cache for m in ("Re-prefill", "Dirty", "Shift", "SUR", "Dense tokens")]
    singles = [greedy_answer(lm, c, case.edit.query_ids, max_new_tokens=MAX_NEW) for c in caches]
    queried, firsts = [], []
    for c in caches:
        work = from_tensors(to_tensors(c))  # a new cache object over c's tensors: the query forward leaves c unchanged
        first = greedy_answer(lm, work, case.edit.query_ids, max_new_tokens=1, copy=False)
        queried.append(work)
        firsts.append(first.first_token_logits)
    assert [cache_length(w) - cache_length(c) for w, c in zip(queried, caches)] == [len(case.edit.query_ids)] * 5
    before = [[(k.clone(), v.clone()) for k, v in to_tensors(w)] for w in queried]
    target = list(singles[0].token_ids) or [5]
    nll = [continuation_nll(lm, c, case.edit, target) for c in caches]
    batch = AnswerBatch.queried(lm, queried, case.edit.query_ids, torch.stack(firsts))
    answers = batch.decode(MAX_NEW)
    assert [a.token_ids for a in answers] == [a.token_ids for a in singles]
    assert [a.finished for a in answers] == [a.finished for a in singles]
    assert len({len(a.token_ids) for a in answers}) >= 2  # rows stop at different steps
    for ans, ref, lp, want in zip(answers, singles, batch.score(target), nll):
        assert torch.equal(ans.first_token_logits, ref.first_token_logits)  # the per-request forward's own logits
        assert -lp.sum() == pytest.approx(want, abs=2 * len(target) * _ulp_tol(ref.first_token_logits))
        assert math.isnan(ans.timings_ms["query"])
    for w, layers in zip(queried, before):
        for (k_now, v_now), (k, v) in zip(to_tensors(w), layers):
            assert torch.equal(k_now, k) and torch.equal(v_now, v)
    with pytest.raises(ValueError, match="first_token_logits"):
        AnswerBatch.queried(lm, queried[:2], case.edit.query_ids, torch.stack(firsts))
    with pytest.raises(ValueError, match="caches"):
        AnswerBatch.queried(lm, [DynamicCache()], case.edit.query_ids, firsts[0][None])


def test_answer_batch_refuses_bad_input(lm, case):
    with pytest.raises(ValueError, match="caches is empty"):
        AnswerBatch(lm, [], case.edit.query_ids)
    cache = repair(lm, prepare(lm, case.edit), "Shift").cache
    with pytest.raises(ValueError, match="query_ids"):
        AnswerBatch(lm, [cache], torch.zeros(0, dtype=torch.long))
    batch = AnswerBatch(lm, [cache], case.edit.query_ids)
    assert batch.score([]).shape == (1, 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        batch.decode(0)


def _comparable(record):
    out = comparable_fields(record)
    out.pop("eval_batch")
    out.pop("timed")  # differs by design: only the per-record pass yields per-request timings
    out.pop("shared_prefix")  # differs by design: a timed case never shares (its Re-prefill is a rebuild from empty)
    # Byte-level: batch shapes round differently (compared within one path in test_record_endpoints_against_oracles).
    out.pop("logits_identical")
    out.pop("logits_digest")
    return out


def _assert_same(a, b, *, tol_logit: float):
    fa, fb = _comparable(a), _comparable(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        x, y = fa[key], fb[key]
        if isinstance(x, float) and isinstance(y, float):
            # A logit change of d moves a softmax by at most 2 d in L1 and a log-probability by at most 2 d; a TV
            # compares two such distributions (4 d), NR_TV = 1 - TV / TV_dirty divides by TV_dirty.
            if key.startswith("nll"):
                tol = 2 * max(a.nll_tokens, 1) * tol_logit
            elif key.startswith("tv") or key == "jsd_reprefill":
                tol = 4 * tol_logit
            elif key in ("gold_nll", "gold_margin", "old_margin"):
                tol = 2 * tol_logit
            elif key == "nr_tv":
                tol = 4 * tol_logit * (1 + abs(a.tv_reprefill / a.tv_dirty_reprefill)) / a.tv_dirty_reprefill
            else:
                tol = 0.0
            assert x == pytest.approx(y, abs=tol, nan_ok=True), key
        else:
            assert x == y, (a.method, a.budget_pct, key)


RUN = dict(max_new_tokens=MAX_NEW, parser=parse_niah_answer, scorer=niah_scorer, seed=2)


@pytest.fixture(scope="module")
def per_record(eos_lm, case):
    return run_case(eos_lm, case, METHODS, BUDGETS, eval_batch=1, **RUN)


@pytest.mark.parametrize("eval_batch", [3, 100])
def test_run_case_batched_equals_per_record(eos_lm, case, per_record, eval_batch):
    lm, one = eos_lm, per_record
    many = run_case(lm, case, METHODS, BUDGETS, eval_batch=eval_batch, **RUN)
    assert len(one) == len(many) == len(REFERENCE_METHODS) + len(ALLOCATOR_METHODS) * len(BUDGETS)
    assert [(r.method, r.budget_pct) for r in one] == [(r.method, r.budget_pct) for r in many]
    lengths = {len(r.answer) for r in one}
    assert len(lengths) >= 2 and {r.finished for r in one} == {True, False}  # rows stop at different steps
    assert all(r.timed for r in one) and not any(r.timed for r in many)
    # Logit magnitude of this model's first-token distributions: one float32 ulp of it bounds a logit's change.
    prepared = prepare(lm, case.edit)
    logits = greedy_answer(lm, repair(lm, prepared, "Re-prefill").cache, case.edit.query_ids,
                           max_new_tokens=1).first_token_logits
    tol = _ulp_tol(logits) * 4  # margin for the other methods' logits, of the same magnitude
    for a, b in zip(one, many):
        _assert_same(a, b, tol_logit=tol)
        assert a.eval_batch == 1 and b.eval_batch == eval_batch
        assert all(np.isfinite(getattr(a, f)) for f in ANSWER_TIMING_FIELDS)
        assert all(np.isnan(getattr(b, f)) for f in ANSWER_TIMING_FIELDS)  # never latency from a batched pass
        assert b.select_ms >= 0 and np.isfinite(a.refresh_ms)  # repairs are timed one at a time, always
        # A shared Re-prefill ran no rebuild: no time for it (every other repair ran and is timed).
        assert np.isnan(b.refresh_ms) if b.method == "Re-prefill" else np.isfinite(b.refresh_ms)
        assert b.shared_prefix and not a.shared_prefix


def test_record_endpoints_against_oracles(eos_lm, case, per_record):
    """Issue 25's endpoints in the per-record path against independent computations on each method's own cache:
    the gold NLL against continuation_nll / T, the gold margin and the logits digest against the answer's logits,
    and the comparisons with Re-prefill (identical to itself; JSD, argmax and sequence agreement)."""
    lm = eos_lm
    prepared = prepare(lm, case.edit)
    gold = list(case.answer_ids)
    ref = greedy_answer(lm, repair(lm, prepared, "Re-prefill").cache, case.edit.query_ids, max_new_tokens=MAX_NEW)
    tol = _ulp_tol(ref.first_token_logits) * 4
    seen = set()
    for r in per_record:
        if r.method not in ("Re-prefill", "Replay", "Dirty", "Shift", "SUR") or r.method in seen:
            continue
        seen.add(r.method)
        cache = repair(lm, prepared, r.method, r.budget_pct if np.isfinite(r.budget_pct) else None).cache
        ans = greedy_answer(lm, cache, case.edit.query_ids, max_new_tokens=MAX_NEW)
        assert r.gold_tokens == len(gold)
        assert r.gold_nll == pytest.approx(continuation_nll(lm, cache, case.edit, gold) / len(gold), abs=2 * tol)
        assert r.gold_margin == pytest.approx(gold_margin(ans.first_token_logits, gold[0]), abs=2 * tol)
        assert r.logits_digest == logits_digest(ans.first_token_logits)  # the same single-row forwards
        assert r.argmax_agree == (int(ans.first_token_logits.argmax()) == int(ref.first_token_logits.argmax()))
        assert r.sequence_agree == (ans.token_ids == ref.token_ids)
        assert 0.0 <= r.jsd_reprefill <= math.log(2)
        if r.method == "Re-prefill":
            assert r.logits_identical and r.jsd_reprefill == 0.0 and r.argmax_agree and r.sequence_agree
    assert seen == {"Re-prefill", "Replay", "Dirty", "Shift", "SUR"}
    dirty = next(r for r in per_record if r.method == "Dirty")
    assert dirty.jsd_reprefill > 0 and not dirty.logits_identical and not dirty.sequence_agree


def test_answer_target_default_and_refusal(lm, case):
    """Without answer_ids a QA case (default parser) teacher-forces gold[0]; a parser leaves it without a target;
    an id outside the vocabulary is refused before any work."""
    from sur_lab.sweeps import answer_target

    qa = dataclasses.replace(case, gold=("blue sky", "azure"), answer_ids=None)
    query = lm.tokenizer.decode(case.edit.query_ids.tolist())
    assert answer_target(lm, qa) == tuple(canonical_answer_ids(lm.tokenizer, "blue sky", query))
    assert answer_target(lm, qa, parser=str) == ()
    recs = run_case(lm, qa, ("Shift", "Re-prefill"), (), max_new_tokens=2, parser=str)
    assert all(np.isnan(r.gold_nll) and np.isnan(r.gold_margin) and r.gold_tokens == 0 for r in recs)
    with pytest.raises(ValueError, match="answer_ids"):
        Case("c", case.edit, answer_ids=(1, -2))
    with pytest.raises(ValueError, match="answer_ids holds token id"):
        run_case(lm, dataclasses.replace(case, answer_ids=(10**6,)), ("Shift",), (), max_new_tokens=2)


def test_timed_cases_are_answered_one_record_at_a_time(monkeypatch, lm, case):
    import sur_lab.sweeps.case as case_mod

    sizes = []
    real = case_mod.AnswerBatch
    monkeypatch.setattr(case_mod, "AnswerBatch", lambda lm_, caches, q, **kw: sizes.append(len(caches)) or real(
        lm_, caches, q, **kw))
    recs = run_case(lm, case, ("Shift", "Re-prefill", "SUR"), (20,), max_new_tokens=3, eval_batch=8, timed=True)
    assert set(sizes) == {1}
    for r in recs:
        assert r.timed and r.answer_ms == pytest.approx(r.query_ms + r.decode_ms)
        assert r.latency_ms == pytest.approx(r.select_ms + r.shift_ms + r.refresh_ms + r.answer_ms)


def test_run_case_skips_stored_records_and_emits_each_once(lm, case):
    from sur_lab.sweeps import record_key

    seen = []
    skip = {record_key("Dirty", float("nan")), record_key("SUR", 20)}
    recs = run_case(lm, case, ("Dirty", "Shift", "Re-prefill", "SUR"), (5, 20), max_new_tokens=2, eval_batch=2,
                    skip=skip, emit=seen.append)
    assert [r.method for r in recs] == ["Shift", "Re-prefill", "SUR"]  # grid order
    assert {(r.method, None if np.isnan(r.budget_pct) else r.budget_pct) for r in recs} == {
        ("Shift", None), ("Re-prefill", None), ("SUR", 5.0)}
    assert sorted(id(r) for r in seen) == sorted(id(r) for r in recs)
    # Dirty's record is skipped, but its first-token logits still normalise NR_TV
    assert all(np.isfinite(r.tv_dirty_reprefill) for r in recs)


def test_a_case_without_a_dirty_cache(lm, case):
    """A Case whose prepare() has no Dirty cache (a composed cache): Dirty is not run; NR_TV is NaN."""

    class NoDirty(Case):
        def prepare(self, lm_):
            prepared = super().prepare(lm_)
            prepared.dirty_cache = None
            return prepared

    c = NoDirty(case.case_id, case.edit, case.gold, case.meta)
    recs = run_case(lm, c, ("Shift", "Replay", "Re-prefill", "SUR"), (20,), max_new_tokens=2, eval_batch=1)
    assert len(recs) == 4 and all(np.isnan(r.nr_tv) and np.isnan(r.tv_dirty_reprefill) for r in recs)
    assert recs[2].tv_reprefill == 0.0 and recs[1].sequence_agree


def test_batches_are_capped_by_memory(monkeypatch, lm, case):
    """A batch never holds more than EVAL_BATCH_BYTES of caches: on a long context it has fewer rows, deterministically."""
    import sur_lab.sweeps.case as case_mod

    sizes = []
    real = case_mod.AnswerBatch

    def recording(lm_, caches, query_ids, **kw):
        sizes.append(len(caches))
        return real(lm_, caches, query_ids, **kw)

    monkeypatch.setattr(case_mod, "AnswerBatch", recording)
    prepared = prepare(lm, case.edit)
    row = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in to_tensors(prepared.dirty_cache))
    monkeypatch.setattr(case_mod, "EVAL_BATCH_BYTES", 2 * row + 1)
    recs = run_case(lm, case, ("Dirty", "Shift", "Replay", "Re-prefill", "SUR"), (20,), max_new_tokens=2,
                    eval_batch=16)
    assert sizes == [2, 2, 1] and len(recs) == 5


def test_packed_refreshes_give_the_sequential_records(eos_lm, case, per_record):
    """A quality sweep may run its budgeted refreshes on the packed executor (one traversal instead of one forward per
    interval): same supports, the same answers, and endpoints within float64 rounding carried to float32 logits; the
    records say which executor ran (it is part of the fingerprint, so a folder never mixes the two)."""
    lm = eos_lm
    packed = run_case(lm, case, METHODS, BUDGETS, eval_batch=100, executor="packed", **RUN)
    prepared = prepare(lm, case.edit)
    logits = greedy_answer(lm, repair(lm, prepared, "Re-prefill").cache, case.edit.query_ids,
                           max_new_tokens=1).first_token_logits
    tol = _ulp_tol(logits) * 4
    assert [(r.method, r.budget_pct) for r in per_record] == [(r.method, r.budget_pct) for r in packed]
    assert {r.executor for r in per_record} == {"sequential"} and {r.executor for r in packed} == {"packed"}
    refreshed = [r for r in packed if r.num_intervals > 1 and 0 < r.allowance < r.suffix_len]
    assert refreshed  # some supports have several intervals: the executors really differ in how they run them
    for a, b in zip(per_record, packed):
        assert (a.positions, a.intervals) == (b.positions, b.intervals)  # the same repairs
        _assert_same(a, dataclasses.replace(b, executor=a.executor), tol_logit=tol)
