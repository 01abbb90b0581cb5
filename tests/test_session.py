"""EditSession: one live cache across appends, deletions and replacements (issue 15).

Exactness on float64 tiny Llama / Qwen3 models (float64 RoPE angles): at full budget the session's cache equals a clean
prefill of its current tokens after any edit sequence; at budget 0 layer 0 does (token-local K/V, re-rotated once from
each row's anchor); a single edit equals the core ``prepare`` + ``repair`` path. Drift: in bfloat16 / float16, 40
chained deletions of 2 tokens stay within 2x of one equivalent Shift's layer-0 key error against a float64 prefill.
Interop: ``model.generate`` from the session's cache decodes what ``EditSession.answer`` does; ``repair_cache`` on a
user's own DynamicCache. Bad input raises before any work and leaves the session unchanged.
"""

from __future__ import annotations

import copy
import functools
import warnings

import numpy as np
import pytest
import torch
from conftest import fp64_tol, make_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sur_lab import EditSession, prepare, repair
from sur_lab.edits import token_edit
from sur_lab.session import repair_cache
from sur_lab.allocators import ALLOCATORS
from sur_lab.cache_ops import clone_cache, layer_kv, max_abs_diff, to_tensors
from sur_lab.forward import prefill
from sur_lab.models import wrap_model

VOCAB = 96
TOL = 1e-12


@functools.cache
def tiny(kind: str):
    return make_tiny_model(kind)


def rand_ids(rng: np.random.Generator, n: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, VOCAB, size=n)).long()


def layer0_diff(cache, reference) -> float:
    (k, v), (kr, vr) = layer_kv(cache, 0), layer_kv(reference, 0)
    return max((k - kr).abs().max().item(), (v - vr).abs().max().item())


# An edit program: ("append", L) | ("delete", start_frac, len) | ("replace", start_frac, len, inserted).
OPS = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 12)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 9)),
    st.tuples(st.just("replace"), st.floats(0, 1), st.integers(1, 9), st.integers(1, 6)),
)


def run_program(session: EditSession, program, rng: np.random.Generator, **edit_kwargs) -> list[int]:
    """Apply ``program`` to ``session`` and to a plain list of ids; returns the expected ids."""
    expected = rand_ids(rng, 24).tolist()
    session.append(torch.tensor(expected))
    for op in program:
        n = len(expected)
        if op[0] == "append" or n < 2:
            new = rand_ids(rng, op[1] if op[0] == "append" else 4).tolist()
            session.append(torch.tensor(new))
            expected += new
            continue
        length = min(op[2], n - 1)
        start = min(int(op[1] * n), n - length)
        if op[0] == "delete":
            record = session.delete(start, start + length, **edit_kwargs)
            expected = expected[:start] + expected[start + length :]
        else:
            new = rand_ids(rng, op[3]).tolist()
            record = session.replace(start, start + length, torch.tensor(new), **edit_kwargs)
            expected = expected[:start] + new + expected[start + length :]
        assert record.num_tokens == len(expected) == len(session)
    return expected


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=st.lists(OPS, min_size=1, max_size=6),
    method=st.sampled_from(["SUR", "Replay", "Re-prefill"]),
    executor=st.sampled_from(["sequential", "packed"]),
    seed=st.integers(0, 2**16),
)
def test_full_budget_edit_sequences_equal_a_clean_prefill(kind, program, method, executor, seed):
    lm = tiny(kind)
    session = EditSession(lm, method=method, budget_pct=100, executor=executor)
    expected = run_program(session, program, np.random.default_rng(seed))
    assert session.tokens.tolist() == expected
    dk, dv = max_abs_diff(session.cache, prefill(lm, session.tokens)[0])
    assert dk <= TOL and dv <= TOL
    assert session.debt == 0
    assert np.array_equal(session.recorded_positions, np.arange(len(expected)))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(OPS, min_size=1, max_size=8), method=st.sampled_from(["SUR", "Shift"]),
       seed=st.integers(0, 2**16))
def test_budget_zero_keeps_layer_zero_equal_to_a_clean_prefill(kind, program, method, seed):
    lm = tiny(kind)
    session = EditSession(lm, method=method, budget_pct=0)
    expected = run_program(session, program, np.random.default_rng(seed))
    assert session.tokens.tolist() == expected
    reference = prefill(lm, session.tokens)[0]
    assert layer0_diff(session.cache, reference) <= TOL
    if any(op[0] != "append" for op in program) and len(expected) > 1:
        # Deeper layers keep the deleted text's influence: the check above is not vacuous.
        dk, dv = max_abs_diff(session.cache, reference)
        assert max(dk, dv) > 1e-6 or session.debt == 0


# Per-edit policies for the debt property: any method, budget, debt budget.
POLICIES = st.fixed_dictionaries({
    "method": st.sampled_from(["SUR", "Shift", "Replay", "Re-prefill", "Dense tokens"]),
    "budget_pct": st.sampled_from([0, 10, 30, 60, 100]),
    "debt_pct": st.sampled_from([0, 0, 25, 50, 100]),
})
POLICY_OPS = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 12)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 9), POLICIES),
    st.tuples(st.just("replace"), st.floats(0, 1), st.integers(1, 9), st.integers(1, 6), POLICIES),
)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(POLICY_OPS, min_size=1, max_size=7), executor=st.sampled_from(["sequential", "packed"]),
       seed=st.integers(0, 2**16))
def test_rows_outside_the_debt_equal_a_clean_prefill(kind, program, executor, seed):
    """Issue 24: the debt tells the truth. After every edit of a random program (mixed methods, budgets and debt
    budgets), the rows before the stale suffix equal a clean prefill of the current tokens (fp64 rounding), so
    ``debt == 0`` means the whole cache does; ``debt_pct=100`` leaves no debt."""
    lm = tiny(kind)
    rng = np.random.default_rng(seed)
    session = EditSession(lm, executor=executor)
    expected = rand_ids(rng, 24).tolist()
    session.append(torch.tensor(expected))
    for op in program:
        n = len(expected)
        if op[0] == "append" or n < 2:
            new = rand_ids(rng, op[1] if op[0] == "append" else 4).tolist()
            session.append(torch.tensor(new))
            expected += new
            policy = {}
        else:
            policy = op[-1]
            length = min(op[2], n - 1)
            start = min(int(op[1] * n), n - length)
            if op[0] == "delete":
                session.delete(start, start + length, **policy)
                expected = expected[:start] + expected[start + length :]
            else:
                new = rand_ids(rng, op[3]).tolist()
                session.replace(start, start + length, torch.tensor(new), **policy)
                expected = expected[:start] + new + expected[start + length :]
        assert session.tokens.tolist() == expected
        stale = session.staleness
        fresh = len(expected) - session.debt
        assert np.all(stale[:fresh] == 0) and np.all(stale[fresh:] > 0)  # the stale rows are a suffix
        reference = prefill(lm, session.tokens)[0]
        if fresh:
            assert max(max_abs_diff(session.cache, reference, slice(0, fresh))) <= fp64_tol(reference)
        if policy.get("debt_pct") == 100 or policy.get("method") == "Re-prefill":
            assert session.debt == 0
    if session.debt == 0:
        assert max(max_abs_diff(session.cache, prefill(lm, session.tokens)[0])) <= fp64_tol(session.cache)


@pytest.mark.parametrize("budget", [0, 30, 100])
def test_one_deletion_equals_the_core_repair(tiny_lm, budget):
    rng = np.random.default_rng(1)
    ids, query = rand_ids(rng, 60), rand_ids(rng, 5)
    session = EditSession(tiny_lm, method="SUR", budget_pct=budget)
    session.append(ids)
    session.set_query(query)
    record = session.delete(12, 25)
    result = repair(tiny_lm, prepare(tiny_lm, token_edit(ids, 12, 13, query)), "SUR", budget)
    assert record.allowance == result.allowance
    assert record.support == result.support
    dk, dv = max_abs_diff(session.cache, result.cache)
    assert dk <= TOL and dv <= TOL
    assert record.suffix_len == 35 and record.num_tokens == 47
    # Only the support's leading run [0, r) is refreshed over fresh rows; a row refreshed after an unrefreshed stale
    # row still reads it (appendix 14), so it stays in the debt.
    positions = record.support.positions if record.support is not None else np.zeros(0, dtype=np.int64)
    run = int(np.argmin(np.append(positions, -1) == np.arange(len(positions) + 1)))
    assert record.debt_before == 35 and record.debt_after == 35 - run
    assert budget != 100 or record.debt_after == 0


def test_staleness_debt_is_tracked_and_can_be_paid(tiny_lm):
    rng = np.random.default_rng(2)
    session = EditSession(tiny_lm, method="Shift")
    session.append(rand_ids(rng, 40))
    session.delete(5, 8)  # rows 5.. saw 3 deleted tokens
    session.replace(20, 22, rand_ids(rng, 4))  # rows 24.. saw 2 more deleted and 4 inserted
    stale = session.staleness
    assert np.array_equal(stale[:5], np.zeros(5)) and np.array_equal(stale[5:20], np.full(15, 3))
    # The inserted rows were computed over the stale rows 5..19: they carry their staleness (appendix 14).
    assert np.array_equal(stale[20:24], np.full(4, 3)) and np.array_equal(stale[24:], np.full(len(stale) - 24, 9))
    assert session.debt == len(stale) - 5
    session.append(rand_ids(rng, 3))  # appended over stale rows: stale as well
    assert session.debt == len(session) - 5 and np.array_equal(session.staleness[-3:], np.full(3, 9))
    # A debt budget of 50 % refreshes the earliest half of the stale rows: exactly those become fresh.
    record = session.delete(0, 1, debt_pct=50)  # every row after 0 becomes stale
    assert record.debt_before == len(session) and record.debt_refreshed == -(-record.debt_before // 2)
    assert record.debt_after == record.debt_before - record.debt_refreshed
    assert np.array_equal(record.refreshed_rows, np.arange(record.debt_refreshed))
    assert set(np.flatnonzero(session.staleness == 0)) == set(record.refreshed_rows.tolist())
    fresh = len(session) - session.debt
    reference = prefill(tiny_lm, session.tokens)[0]
    assert max(max_abs_diff(session.cache, reference, slice(0, fresh))) <= fp64_tol(reference)
    assert max(max_abs_diff(session.cache, reference, slice(fresh, fresh + 1))) > 1e-6  # the debt is real
    record = session.delete(0, 1, debt_pct=100)
    assert session.debt == 0 and record.debt_refreshed == len(session)
    dk, dv = max_abs_diff(session.cache, prefill(tiny_lm, session.tokens)[0])
    assert dk <= TOL and dv <= TOL


def _rounded_pair(dtype):
    """A ``dtype`` tiny model and a float64 copy holding the same (rounded) weights."""
    lm64 = make_tiny_model("llama", seed=3)
    low = copy.deepcopy(lm64.model).to(dtype)
    lm64.model.load_state_dict({k: v.to(torch.float64) for k, v in low.state_dict().items()})
    return wrap_model(low), lm64


def _rel_key_error(cache, reference, rows: slice) -> float:
    k, kr = layer_kv(cache, 0)[0][:, :, rows].double(), layer_kv(reference, 0)[0][:, :, rows]
    return ((k - kr).norm() / kr.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forty_chained_deletions_stay_within_twice_one_shift(dtype):
    lm, lm64 = _rounded_pair(dtype)
    rng = np.random.default_rng(4)
    p, d, S = 8, 80, 64
    ids = rand_ids(rng, p + d + S)
    chained = EditSession(lm, method="Shift")
    chained.append(ids)
    for _ in range(40):
        chained.delete(p, p + 2)
    single = EditSession(lm, method="Shift")
    single.append(ids)
    single.delete(p, p + d)
    assert torch.equal(chained.tokens, single.tokens)
    reference = prefill(lm64, chained.tokens)[0]
    rows = slice(p, p + S)
    err_chained = _rel_key_error(chained.cache, reference, rows)
    err_single = _rel_key_error(single.cache, reference, rows)
    err_reprefill = _rel_key_error(prefill(lm, chained.tokens)[0], reference, rows)
    assert 0 < err_single < 0.05 and 0 < err_reprefill
    assert err_chained <= 2 * err_single, (err_chained, err_single, err_reprefill)
    assert np.array_equal(chained.recorded_positions[p:], np.arange(p + d, p + d + S))


@pytest.mark.parametrize("kwarg", ["cache", "past_key_values"])
def test_generate_from_the_session_cache_equals_answer(tiny_lm, kwarg):
    rng = np.random.default_rng(5)
    session = EditSession(tiny_lm, method="SUR", budget_pct=20)
    session.append(rand_ids(rng, 40))
    session.append(rand_ids(rng, 12))
    session.delete(6, 15)
    session.replace(20, 24, rand_ids(rng, 2))
    query = rand_ids(rng, 4)
    before = [t.clone() for kv in to_tensors(session.cache) for t in kv]
    ours = session.answer(query, max_new_tokens=10)
    input_ids = torch.cat((session.tokens, query))[None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values: the deprecated name in transformers 5.x
        out = tiny_lm.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **{kwarg: session.cache},
            max_new_tokens=10, do_sample=False, eos_token_id=list(tiny_lm.eos_token_ids) or None, pad_token_id=0,
        )
    generated = out[0, input_ids.shape[1] :].tolist()
    if ours.finished:  # generate keeps the EOS token; greedy_answer drops it
        assert generated[len(ours.token_ids)] in tiny_lm.eos_token_ids
        generated = generated[: len(ours.token_ids)]
    assert tuple(generated) == ours.token_ids and len(ours.token_ids) > 0
    after = [t for kv in to_tensors(session.cache) for t in kv]
    assert all(torch.equal(x, y) for x, y in zip(before, after)) and len(session) == input_ids.shape[1] - 4


@pytest.mark.parametrize("budget", [10, 100])
def test_repair_cache_on_a_users_own_cache(tiny_lm, budget):
    rng = np.random.default_rng(6)
    ids, query = rand_ids(rng, 50), rand_ids(rng, 3)
    cache = prefill(tiny_lm, ids)[0]
    original = clone_cache(cache)
    out = repair_cache(tiny_lm.model, cache, ids[None], (10, 18), budget_pct=budget, query_ids=query)
    expected = repair(tiny_lm, prepare(tiny_lm, token_edit(ids, 10, 8, query)), "SUR", budget).cache
    assert max(max_abs_diff(out, expected)) <= TOL
    assert max(max_abs_diff(cache, original)) == 0.0 and cache.get_seq_length() == 50
    if budget == 100:
        edited = torch.cat((ids[:10], ids[18:]))
        assert max(max_abs_diff(out, prefill(tiny_lm, edited)[0])) <= TOL
    with pytest.raises(ValueError, match="input_ids"):
        repair_cache(tiny_lm.model, cache, ids[:-1], (10, 18))
    with pytest.raises(ValueError, match="span"):
        repair_cache(tiny_lm.model, cache, ids, (18, 10))


def _snapshot(session: EditSession):
    return (session.tokens.tolist(), [t for kv in to_tensors(session.cache) for t in kv], session.staleness.tolist(),
            session.recorded_positions.tolist(), len(session.history), session.debt)


def _assert_unchanged(session: EditSession, snap) -> None:
    tokens, tensors, stale, positions, n_hist, debt = snap
    assert session.tokens.tolist() == tokens and session.staleness.tolist() == stale
    assert session.recorded_positions.tolist() == positions and len(session.history) == n_hist
    assert session.debt == debt
    now = [t for kv in to_tensors(session.cache) for t in kv]
    assert len(now) == len(tensors) and all(a is b for a, b in zip(now, tensors))


VALUE_ERRORS = [
    (lambda s: s.delete(5, 5), "empty"),
    (lambda s: s.delete(9, 3), "empty"),
    (lambda s: s.delete(-1, 3), "out of range"),
    (lambda s: s.delete(34, 40), "out of range"),
    (lambda s: s.delete(20, 31), "pending query"),
    (lambda s: s.delete(28, 32), "pending query"),
    (lambda s: s.delete(30, 31), "pending query"),
    (lambda s: s.replace(29, 31, torch.tensor([1])), "pending query"),
    (lambda s: s.delete(True, 3), "integers"),
    (lambda s: s.delete(1.5, 3), "integers"),
    (lambda s: s.replace(2, 4, torch.tensor([], dtype=torch.long)), "content"),
    (lambda s: s.replace(2, 4, torch.tensor([VOCAB])), "content"),
    (lambda s: s.replace(2, 4, "text"), "tokenizer"),
    (lambda s: s.append(torch.tensor([0.5])), "content"),
    (lambda s: s.delete(2, 4, method="Dirty"), "Dirty"),
    (lambda s: s.delete(2, 4, method="nope"), "method"),
    (lambda s: s.delete(2, 4, budget_pct=101), "budget_pct"),
    (lambda s: s.delete(2, 4, executor="nope"), "executor"),
    (lambda s: s.delete(2, 4, debt_pct=-1), "debt_pct"),
    (lambda s: s.answer(torch.tensor([], dtype=torch.long)), "query"),
    (lambda s: s.set_query(torch.tensor([], dtype=torch.long)), "content"),
]
# Issue 38: inputs of the wrong kind are refused before any tensor is built, naming the argument.
KIND_ERRORS = [
    (lambda s: s.append(None), "content must be text or integer token ids.*got NoneType"),
    (lambda s: s.append([1, 2, "three"]), r"content must be text or integer token ids, one kind; content\[2\] is str"),
    (lambda s: s.append([1, None]), r"content\[1\] is NoneType"),
    (lambda s: s.append([True, 3]), r"content\[0\] is bool"),
    (lambda s: s.append({"role": "user", "content": "hi"}), "content must be text or integer token ids.*dict"),
    (lambda s: s.replace(2, 4, None), "content must be text or integer token ids.*NoneType"),
    (lambda s: s.replace(2, 4, [5, "x"]), r"content\[1\] is str"),
    (lambda s: s.set_query(None), "content must be text or integer token ids"),
    (lambda s: s.set_query([1, 2], question=[3, "q"]), r"question\[1\] is str"),
    (lambda s: s.answer([4, None]), r"query\[1\] is NoneType"),
]


@pytest.mark.parametrize("call, match, error", [(c, m, ValueError) for c, m in VALUE_ERRORS]
                         + [(c, m, TypeError) for c, m in KIND_ERRORS])
def test_bad_input_raises_before_any_change(call, match, error):
    session = EditSession(tiny("llama"), method="SUR", budget_pct=30)
    session.append(rand_ids(np.random.default_rng(7), 30))
    session.set_query(torch.tensor([3, 4, 5]))
    snap = _snapshot(session)
    with pytest.raises(error, match=match):
        call(session)
    _assert_unchanged(session, snap)
    assert session.pending_query.tolist() == [3, 4, 5]


def test_an_error_inside_the_repair_leaves_the_session_unchanged(monkeypatch):
    def broken(request):
        raise RuntimeError("allocator failed")

    monkeypatch.setitem(ALLOCATORS, "broken-for-test", broken)
    session = EditSession(tiny("qwen3"), method="broken-for-test", budget_pct=30)
    session.append(rand_ids(np.random.default_rng(8), 30))
    session.delete(0, 2, method="Shift")
    snap = _snapshot(session)
    for call in (lambda: session.delete(3, 9), lambda: session.replace(3, 9, torch.tensor([1, 2]))):
        with pytest.raises(RuntimeError, match="allocator failed"):
            call()
        _assert_unchanged(session, snap)
    with pytest.raises(ValueError, match="query"):
        EditSession(tiny("qwen3")).answer()
    session.clear_query()
    with pytest.raises(ValueError, match="out of range"):
        session.delete(20, 29)
    _assert_unchanged(session, snap)


def test_deleting_everything_then_appending_again(tiny_lm):
    rng = np.random.default_rng(9)
    session = EditSession(tiny_lm, method="SUR", budget_pct=50)
    session.append(rand_ids(rng, 10))
    record = session.delete(0, 10)
    assert len(session) == 0 and record.suffix_len == 0 and session.cache.get_seq_length() == 0
    session.append(rand_ids(rng, 7))
    assert max(max_abs_diff(session.cache, prefill(tiny_lm, session.tokens)[0])) <= TOL


@pytest.mark.slow
def test_text_session_keeps_text_and_units(smol):
    tok = smol.tokenizer
    session = EditSession(smol, method="SUR", budget_pct=20)
    turns = ["<|im_start|>user\nFind the capital of France.<|im_end|>\n",
             "<|im_start|>tool\nParis is the capital of France. It is large.<|im_end|>\n",
             "<|im_start|>tool\nLyon is a city in France. It has a river.<|im_end|>\n"]
    for turn in turns:
        session.append(turn)
    assert session.text == "".join(turns)
    assert session.tokens.tolist() == [i for t in turns for i in tok(t, add_special_tokens=False)["input_ids"]]
    n0 = len(tok(turns[0], add_special_tokens=False)["input_ids"])
    n1 = len(tok(turns[1], add_special_tokens=False)["input_ids"])
    session.set_query("<|im_start|>user\nWhich city?<|im_end|>\n<|im_start|>assistant\n", question="Which city?")
    record = session.delete(n0, n0 + n1)
    assert session.text == turns[0] + turns[2]
    assert record.allowance == -(-record.suffix_len * 20 // 100)
    units = record.selection.diagnostics["units"]
    assert units[0].start == 0 and units[-1].end == record.suffix_len


def test_fork_follows_its_own_policy_without_touching_the_parent(tiny_lm):
    rng = np.random.default_rng(10)
    parent = EditSession(tiny_lm, method="Shift")
    parent.append(rand_ids(rng, 30))
    parent.set_query(torch.tensor([1, 2]))
    snap = _snapshot(parent)
    child = parent.fork(method="Replay")
    child.delete(4, 9)
    _assert_unchanged(parent, snap)
    assert child.pending_query.tolist() == [1, 2] and child.history[-1].method == "Replay"
    assert max(max_abs_diff(child.cache, prefill(tiny_lm, child.tokens)[0])) <= TOL
    with pytest.raises(ValueError, match="budget_pct"):
        parent.fork(budget_pct=-1)


@pytest.mark.parametrize("executor", ["packed", "packed-sdpa"])
def test_packed_executors_follow_the_sequential_session(tiny_lm, executor):
    program = [("delete", 0.3, 7), ("append", 9), ("replace", 0.5, 4, 3), ("delete", 0.1, 2), ("delete", 0.6, 5)]
    sessions = {}
    for name in ("sequential", executor):
        session = EditSession(tiny_lm, method="SUR", budget_pct=30, executor=name, debt_pct=25)
        session.set_query(torch.tensor([5, 6, 7]))
        run_program(session, program, np.random.default_rng(11))
        sessions[name] = session
    ref, out = sessions["sequential"], sessions[executor]
    assert torch.equal(ref.tokens, out.tokens) and np.array_equal(ref.staleness, out.staleness)
    assert all(np.array_equal(a.refreshed_rows, b.refreshed_rows) for a, b in zip(ref.history, out.history))
    assert max(max_abs_diff(ref.cache, out.cache)) <= TOL
    assert any(r.debt_refreshed for r in ref.history) and any(r.allowance for r in ref.history)
