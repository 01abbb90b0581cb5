"""EditSession.sync (issue 27): a whole new prompt becomes edits and one budgeted repair; check_model, the gate.

Exactness on float64 tiny models: random programs of prompt rewrites (several insertions, deletions and replacements
per sync, at random places, over several syncs) give at 100 % the clean prefill of the new prompt and at 0 % (Shift)
layer 0 of a prefill at the new positions; the rows outside the staleness debt always equal a clean prefill. Chat
message lists are rendered with a real tokenizer's template (Qwen2.5's, from ``shared/data/tokenizers``) on a tiny
model sized to its vocabulary. The diff is minimal on hand-made cases (a pure append computes only the new tokens, an
unchanged prompt nothing), a one-edit sync is the matching ``delete`` / ``replace``, and the policy falls back to
prefix reuse exactly where it says. ``check_model`` passes on the tiny models and fails on a patched RoPE and on an
attention that ignores its mask.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from conftest import fp64_tol, make_tiny_model
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sur_lab import EditSession, SyncPolicy, check_model
from sur_lab.model_check import ModelCheckError
from sur_lab.cache_ops import layer_kv, max_abs_diff, to_tensors
from sur_lab.edits import chat_segments, tokenize_segments
from sur_lab.forward import prefill
from sur_lab.model_check import ModelCheckReport
from sur_lab.sync import diff_tokens

VOCAB = 96
ALWAYS_REPAIR = SyncPolicy(min_stale_rows=0, max_new_share=1.0)


@functools.cache
def tiny(kind: str = "llama", **kwargs):
    return make_tiny_model(kind, **kwargs)


def rand_ids(rng: np.random.Generator, n: int, vocab: int = VOCAB) -> list[int]:
    return rng.integers(0, vocab, size=n).tolist()


def layer0_diff(cache, reference) -> float:
    (k, v), (kr, vr) = layer_kv(cache, 0), layer_kv(reference, 0)
    return max((k - kr).abs().max().item(), (v - vr).abs().max().item())


# One rewrite: ("insert", at, length) | ("delete", at, length) | ("replace", at, length, inserted), places as fractions.
REWRITE = st.one_of(
    st.tuples(st.just("insert"), st.floats(0, 1), st.integers(1, 6)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 8)),
    st.tuples(st.just("replace"), st.floats(0, 1), st.integers(1, 8), st.integers(1, 6)),
)


def rewrite(ids: list[int], edits, rng: np.random.Generator) -> list[int]:
    """Apply several rewrites to a copy of ``ids`` (at random places, in order; the prompt keeps >= 1 token)."""
    out = list(ids)
    for op in edits:
        n = len(out)
        at = min(int(op[1] * (n + 1)), n)
        if op[0] == "insert":
            out[at:at] = rand_ids(rng, op[2])
        elif n > 1:
            length = min(op[2], n - 1, n - min(at, n - 1))
            at = min(at, n - length)
            out[at : at + length] = [] if op[0] == "delete" else rand_ids(rng, op[3])
    return out


SYNCS = st.lists(st.tuples(st.lists(REWRITE, min_size=1, max_size=4), st.integers(0, 8)), min_size=1, max_size=3)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(syncs=SYNCS, method=st.sampled_from(["SUR", "Replay", "Dense tokens"]),
       executor=st.sampled_from(["sequential", "packed"]), seed=st.integers(0, 2**16))
def test_full_budget_syncs_give_the_clean_prefill(kind, syncs, method, executor, seed):
    lm = tiny(kind)
    rng = np.random.default_rng(seed)
    session = EditSession(lm, method=method, budget_pct=100, executor=executor, sync_policy=ALWAYS_REPAIR)
    ids = rand_ids(rng, 30)
    session.append(torch.tensor(ids))
    for edits, append in syncs:
        ids = rewrite(ids, edits, rng) + rand_ids(rng, append)
        record = session.sync(torch.tensor(ids))
        assert session.tokens.tolist() == ids and record.num_tokens == len(ids)
        reference = prefill(lm, torch.tensor(ids))[0]
        assert max(max_abs_diff(session.cache, reference)) <= fp64_tol(reference), record.path
        assert session.debt == 0 and np.array_equal(session.recorded_positions, np.arange(len(ids)))
        assert record.reused + record.recomputed >= len(ids) or record.path == "unchanged"


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(syncs=SYNCS, budget=st.sampled_from([0, 20, 60]), debt_pct=st.sampled_from([0, 0, 50]),
       seed=st.integers(0, 2**16))
def test_partial_syncs_keep_layer0_and_the_rows_outside_the_debt_exact(kind, syncs, budget, debt_pct, seed):
    lm = tiny(kind)
    rng = np.random.default_rng(seed)
    session = EditSession(lm, method="SUR" if budget else "Shift", budget_pct=budget, debt_pct=debt_pct,
                          sync_policy=ALWAYS_REPAIR)
    ids = rand_ids(rng, 30)
    session.append(torch.tensor(ids))
    for edits, append in syncs:
        ids = rewrite(ids, edits, rng) + rand_ids(rng, append)
        session.sync(torch.tensor(ids))
        reference = prefill(lm, torch.tensor(ids))[0]
        assert layer0_diff(session.cache, reference) <= fp64_tol(reference)  # a prefill at the new positions
        fresh = len(ids) - session.debt
        if fresh:
            assert max(max_abs_diff(session.cache, reference, slice(0, fresh))) <= fp64_tol(reference)


# ---------------------------------------------------------------------------------------------------------------------
# The diff is minimal; one-edit syncs are the matching edits


def _session(lm, ids, **kwargs) -> EditSession:
    session = EditSession(lm, **kwargs)
    session.append(torch.tensor(ids))
    return session


def test_an_unchanged_prompt_recomputes_nothing(tiny_lm):
    ids = rand_ids(np.random.default_rng(1), 40)
    session = _session(tiny_lm, ids, method="SUR", budget_pct=50, debt_pct=100)
    before = [t for kv in to_tensors(session.cache) for t in kv]
    record = session.sync(torch.tensor(ids))
    assert record.path == "unchanged" and record.recomputed == 0 and record.reused == 40
    assert record.deleted == record.inserted == record.rerotated == 0
    assert all(a is b for a, b in zip(before, [t for kv in to_tensors(session.cache) for t in kv]))


def test_a_pure_append_computes_only_the_new_tokens(tiny_lm):
    rng = np.random.default_rng(2)
    ids, more = rand_ids(rng, 40), rand_ids(rng, 7)
    session = _session(tiny_lm, ids, method="SUR", budget_pct=50)
    calls = []
    handle = tiny_lm.model.model.embed_tokens.register_forward_hook(lambda m, a, o: calls.append(a[0].numel()))
    try:
        record = session.sync(torch.tensor(ids + more))
    finally:
        handle.remove()
    assert record.path == "tail" and calls == [7]  # counted independently: the embedding saw the 7 new tokens only
    assert record.recomputed == 7 and record.reused == 40 and record.inserted == 7 and record.deleted == 0
    reference = prefill(tiny_lm, torch.tensor(ids + more))[0]
    assert max(max_abs_diff(session.cache, reference)) <= fp64_tol(reference)


@pytest.mark.parametrize(
    "old,new,kept,deleted,inserted,first",
    [
        ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, -1, -1], 0, 2, 6),
        ([1, 2, 3, 4, 5, 6], [1, 2, 5, 6], [0, 1, 4, 5], 2, 0, 2),
        ([1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9, 5, 6], [0, 1, -1, -1, -1, 4, 5], 2, 3, 2),
        ([1, 2, 3, 4, 5, 6], [9, 1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, 3, 4, 5], 0, 1, 0),
        ([1, 2, 3, 4, 5, 6, 7, 8], [1, 3, 4, 9, 6, 7], [0, 2, 3, -1, 5, 6], 3, 1, 1),
        ([1, 2, 3], [1, 2], [0, 1], 1, 0, 2),
        ([1, 1, 1, 2, 1, 1], [1, 1, 2, 1, 1], [0, 1, 3, 4, 5], 1, 0, 2),  # frequent tokens match too (no autojunk)
    ],
)
def test_the_diff_is_minimal_on_hand_made_cases(old, new, kept, deleted, inserted, first):
    plan = diff_tokens(torch.tensor(old), torch.tensor(new))
    assert plan.source.tolist() == kept and plan.deleted == deleted and plan.inserted == inserted
    assert plan.first_change == first


@pytest.mark.parametrize("budget", [0, 30, 100])
def test_a_one_deletion_sync_is_delete(tiny_lm, budget):
    rng = np.random.default_rng(3)
    ids = rand_ids(rng, 60)
    a = _session(tiny_lm, ids, method="SUR", budget_pct=budget, sync_policy=ALWAYS_REPAIR)
    b = _session(tiny_lm, ids, method="SUR", budget_pct=budget)
    for s in (a, b):
        s.set_query(torch.tensor([4, 5, 6]))
    synced = a.sync(torch.tensor(ids[:12] + ids[25:]))
    deleted = b.delete(12, 25)
    assert synced.path == "repair" and synced.allowance == deleted.allowance and synced.support == deleted.support
    assert max(max_abs_diff(a.cache, b.cache)) <= fp64_tol(b.cache)
    assert synced.deleted == 13 and synced.rerotated == 35 and synced.stale_rows == 35
    assert synced.debt_after == deleted.debt_after


@pytest.mark.parametrize("budget", [0, 30, 100])
def test_a_one_replacement_sync_is_replace(tiny_lm, budget):
    rng = np.random.default_rng(4)
    ids = rand_ids(rng, 60)
    new = sorted(set(range(VOCAB)) - set(ids))[:5]  # tokens the old prompt lacks: the diff is this one replacement
    a = _session(tiny_lm, ids, method="SUR", budget_pct=budget, sync_policy=ALWAYS_REPAIR)
    b = _session(tiny_lm, ids, method="SUR", budget_pct=budget)
    synced = a.sync(torch.tensor(ids[:20] + new + ids[28:]))
    replaced = b.replace(20, 28, torch.tensor(new))
    assert synced.allowance == replaced.allowance and synced.support == replaced.support
    assert max(max_abs_diff(a.cache, b.cache)) <= fp64_tol(b.cache)
    assert np.array_equal(a.staleness, b.staleness)


# ---------------------------------------------------------------------------------------------------------------------
# The policy


@pytest.mark.parametrize(
    "policy,change,path",
    [
        (SyncPolicy(min_stale_rows=10, max_new_share=1.0), 50, "prefix-reuse"),  # 9 kept rows after the change
        (SyncPolicy(min_stale_rows=9, max_new_share=1.0), 50, "repair"),  # exactly 9: repaired
        (SyncPolicy(min_stale_rows=0, max_new_share=0.5), 0, "repair"),  # 2 new of 52 rows after the change
        (SyncPolicy(min_stale_rows=0, max_new_share=0.03), 0, "prefix-reuse"),  # 2/52 > 3 %
        (SyncPolicy(min_stale_rows=0, max_new_share=2 / 52), 0, "repair"),  # at the threshold: repaired
    ],
)
def test_the_policy_falls_back_where_it_says(tiny_lm, policy, change, path):
    rng = np.random.default_rng(5)
    ids = rand_ids(rng, 60)
    session = _session(tiny_lm, ids, method="SUR", budget_pct=20, sync_policy=policy)
    new = ids[:change] + [1, 2] + ids[change + 1 :]  # replace one token by two
    record = session.sync(torch.tensor(new))
    assert record.path == path and record.stale_rows == 59 - change
    if path == "prefix-reuse":
        assert record.recomputed == len(new) - change and record.reused == change and session.debt == 0
        reference = prefill(tiny_lm, torch.tensor(new))[0]
        assert max(max_abs_diff(session.cache, reference)) <= fp64_tol(reference)


def test_re_prefill_syncs_prefill_everything(tiny_lm):
    ids = rand_ids(np.random.default_rng(6), 30)
    session = _session(tiny_lm, ids, method="Re-prefill")
    record = session.sync(torch.tensor(ids[:10] + ids[12:]))
    assert record.path == "re-prefill" and record.recomputed == 28 and record.reused == 0


@pytest.mark.parametrize(
    "new,match",
    [
        ([], "new"),
        (torch.tensor([VOCAB]), "new"),
        ("some text", "tokenizer"),
        (["a", "b"], "tokenizer"),
        ([{"role": "user", "content": "hi"}], "tokenizer"),
        (torch.tensor([0.5, 1.5]), "new"),
    ],
)
def test_bad_sync_input_is_refused_before_any_change(tiny_lm, new, match):
    session = _session(tiny_lm, rand_ids(np.random.default_rng(7), 20))
    before = session.tokens.tolist(), len(session.history)
    with pytest.raises(ValueError, match=match):
        session.sync(new)
    with pytest.raises(ValueError, match="policy"):
        session.sync(torch.tensor([1, 2]), policy={"min_stale_rows": 3})
    assert (session.tokens.tolist(), len(session.history)) == before


@pytest.mark.parametrize("kwargs,match", [({"min_stale_rows": -1}, "min_stale_rows"),
                                          ({"min_stale_rows": 2.5}, "min_stale_rows"),
                                          ({"max_new_share": 1.5}, "max_new_share"),
                                          ({"max_new_share": True}, "max_new_share")])
def test_sync_policy_refuses_out_of_range_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyncPolicy(**kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# Chat messages with a real tokenizer and template


@functools.cache
def qwen_tokenizer():
    from transformers import AutoTokenizer

    from sur_lab.paths import default_data_dir

    try:  # the tokenizers sit beside the QA data: ../shared/data/tokenizers
        folder = default_data_dir().parent / "tokenizers" / "qwen2.5-coder-0.5b-instruct"
    except FileNotFoundError as err:
        pytest.skip(str(err))
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent")
    return AutoTokenizer.from_pretrained(folder)


@functools.cache
def chat_lm():
    """A tiny float64 Llama sized to the Qwen2.5 tokenizer's vocabulary, with that tokenizer."""
    import dataclasses

    tok = qwen_tokenizer()
    lm = make_tiny_model("llama", vocab_size=len(tok))
    return dataclasses.replace(lm, tokenizer=tok)


WORDS = "the tool returned three failing tests in the parser module after the lexer change".split()


def _text(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n).tolist()) + "."


CHAT_REWRITE = st.sampled_from(["compact", "drop", "plan", "append", "edit-middle"])


def rewrite_messages(messages: list[dict], ops, rng: np.random.Generator) -> list[dict]:
    """An agent runtime's rewrites: compact an old tool output into one line, drop a superseded one, rewrite the
    plan (message 1), edit words inside a message, append a turn."""
    out = [dict(m) for m in messages]
    for op in ops:
        tools = [i for i, m in enumerate(out) if m["role"] == "tool"]
        if op == "compact" and tools:
            i = tools[int(rng.integers(len(tools)))]
            out[i]["content"] = "Summary: " + _text(rng, 3)
        elif op == "drop" and len(tools) > 1:
            del out[tools[int(rng.integers(len(tools)))]]
        elif op == "plan":
            out[1]["content"] = "Plan: " + _text(rng, 6)
        elif op == "edit-middle":
            i = int(rng.integers(1, len(out)))
            words = out[i]["content"].split(" ")
            words[len(words) // 2 : len(words) // 2 + 1] = _text(rng, 2).split(" ")
            out[i]["content"] = " ".join(words)
        else:
            out.append({"role": "tool", "content": _text(rng, int(rng.integers(4, 12)))})
    return out


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(st.lists(CHAT_REWRITE, min_size=1, max_size=3), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
@example(turns=[["compact"], ["append", "drop"]], seed=6)  # the second rewrite gives the prompt back unchanged
def test_chat_rewrites_at_full_budget_give_the_clean_prefill(turns, seed):
    lm = chat_lm()
    tok = lm.tokenizer
    rng = np.random.default_rng(seed)
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Plan: " + _text(rng, 6)},
                {"role": "tool", "content": _text(rng, 10)},
                {"role": "tool", "content": _text(rng, 8)}]
    full = EditSession(lm, method="SUR", budget_pct=100, sync_policy=ALWAYS_REPAIR)
    shift = EditSession(lm, method="Shift", sync_policy=ALWAYS_REPAIR)
    for session in (full, shift):
        session.sync(messages)
    for ops in turns:
        messages = rewrite_messages(messages, ops, rng)
        expected = torch.tensor([t for x in tokenize_segments(tok, chat_segments(tok, messages))[0] for t in x])
        reference = prefill(lm, expected)[0]
        for session in (full, shift):
            before = session.tokens.clone()
            record = session.sync(messages)
            assert torch.equal(session.tokens, expected) and session.text == tok.decode(expected.tolist())
            # a rewrite may give the prompt back unchanged (append, then drop what was appended): nothing to do then
            assert (record.inserted + record.deleted > 0) == (not torch.equal(before, expected))
        assert max(max_abs_diff(full.cache, reference)) <= fp64_tol(reference)
        assert layer0_diff(shift.cache, reference) <= fp64_tol(reference)


def test_message_boundaries_are_token_boundaries():
    tok = qwen_tokenizer()
    messages = [{"role": "user", "content": "Fix the build."}, {"role": "tool", "content": "3 tests failed.\n\nx"}]
    segments = chat_segments(tok, messages, add_generation_prompt=True)
    assert "".join(segments) == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                       enable_thinking=False)
    assert segments[-1] == "<|im_start|>assistant\n" and "3 tests failed." in segments[1]
    # A message's tokens do not depend on its neighbours: rewriting message 0 leaves message 1's ids as they were.
    ids = tokenize_segments(tok, segments)[0]
    other = tokenize_segments(tok, chat_segments(tok, [{"role": "user", "content": "Other."}, messages[1]]))[0]
    assert ids[1] == other[1]
    with pytest.raises(ValueError, match="messages"):
        chat_segments(tok, [{"role": "user"}])


# ---------------------------------------------------------------------------------------------------------------------
# Issue 38: resent text, prefix-stable chat templates, input kinds, debt_pct on an unchanged prompt

TURNS = ["<|im_start|>system\nYou are a coding agent.<|im_end|>\n", "<|im_start|>user\nFix the parser.\n",
         "\nThe lexer changed yesterday.<|im_end|>\n"]  # the third starts with the newline the second ends with


def _text_session(**kwargs) -> EditSession:
    session = EditSession(chat_lm(), **kwargs)
    for turn in TURNS:
        session.append(turn)
    return session


def _tok_ids(text: str) -> list[int]:
    return chat_lm().tokenizer(text, add_special_tokens=False)["input_ids"]


def test_resent_unchanged_text_is_a_no_op():
    session = _text_session(method="SUR", budget_pct=0)
    # Tokenized whole, the text merges the seam "\n" + "\n": a token diff alone would see an edit there.
    assert _tok_ids(session.text) != session.tokens.tolist()
    before = session.tokens.tolist(), [t for kv in to_tensors(session.cache) for t in kv]
    record = session.sync(session.text)
    assert record.path == "unchanged" and record.recomputed == 0 and record.deleted == record.inserted == 0
    assert session.debt == 0 and session.tokens.tolist() == before[0]
    assert all(a is b for a, b in zip(before[1], [t for kv in to_tensors(session.cache) for t in kv]))


def test_resent_text_plus_a_suffix_is_an_append():
    session = _text_session(method="SUR", budget_pct=0)
    appended = session.fork()
    turn = "<|im_start|>assistant\nI will look at the lexer first.<|im_end|>\n"
    record = session.sync(session.text + turn)
    appended.append(turn)
    assert record.path == "tail" and record.deleted == 0 and record.inserted == len(_tok_ids(turn))
    assert record.recomputed == len(_tok_ids(turn)) and record.debt_after == 0
    assert torch.equal(session.tokens, appended.tokens) and session.text == appended.text
    assert max(max_abs_diff(session.cache, appended.cache)) == 0.0


@pytest.mark.parametrize("budget", [0.0, 100.0])
def test_a_text_edit_retokenizes_between_stable_boundaries_and_repairs_the_seam(budget):
    lm = chat_lm()
    session = _text_session(method="SUR", budget_pct=budget, sync_policy=ALWAYS_REPAIR)
    old = session.tokens.tolist()
    new_text = session.text.replace("Fix the parser.\n", "Fix the parser and the lexer.\n")
    record = session.sync(new_text)
    assert session.text == new_text
    assert lm.tokenizer.decode(session.tokens.tolist(), skip_special_tokens=False) == new_text
    # Rows before the boundary at " parser" and from the next message boundary on keep their cached ids: the old
    # seam "\n" | "\n" after the edited message is kept, not re-tokenized into one "\n\n".
    kept_tail = _tok_ids(TURNS[2])
    assert session.tokens.tolist()[-len(kept_tail):] == kept_tail == old[-len(kept_tail):]
    # The boundary before " parser" and the one after "." pass the round trip: only " parser and the lexer." is
    # tokenized again, and its diff against " parser." is the three inserted words.
    assert record.path == "repair" and record.deleted == 0 and record.inserted == len(_tok_ids(" and the lexer")) == 3
    reference = prefill(lm, session.tokens)[0]
    if budget == 100.0:
        assert record.debt_after == 0 and max(max_abs_diff(session.cache, reference)) <= fp64_tol(reference)
    else:  # Shift only: the stale rows after the edit are counted in the debt, the rows before it are exact
        assert record.debt_after == record.stale_rows == len(old) - record.first_change > len(kept_tail)
        n = len(session) - session.debt
        assert max(max_abs_diff(session.cache, reference, slice(0, n))) <= fp64_tol(reference)


def test_a_suffix_that_merges_with_the_cached_end_is_retokenized_from_a_stable_boundary():
    session = _text_session(method="SUR", budget_pct=0)
    n, old = len(session), session.tokens.tolist()
    text = session.text + "\nDone."  # the cached text ends with "\n": whole, "\n\n" is one token
    record = session.sync(text)
    # The end of the cached text fails the round trip; the boundary after the special token <|im_end|> is stable:
    # its last row is tokenized again with the suffix, canonically, and the prompt stays an append (no stale row).
    assert session.tokens.tolist() == old[:-1] + _tok_ids("\n\nDone.") and session.text == text
    assert record.path == "tail" and record.first_change == n - 1 and record.deleted == 1
    assert record.recomputed == record.inserted == len(_tok_ids("\n\nDone.")) and session.debt == 0


def test_debt_pct_is_honoured_on_an_unchanged_prompt(tiny_lm):
    ids = rand_ids(np.random.default_rng(3), 40)
    session = _session(tiny_lm, ids, method="SUR", budget_pct=0, sync_policy=ALWAYS_REPAIR)
    new = ids[:10] + ids[14:]
    session.sync(torch.tensor(new))
    debt = session.debt
    assert debt == len(new) - 10  # b = 0: every row after the deletion is stale
    record = session.sync(torch.tensor(new), debt_pct=100)
    assert record.path == "unchanged" and record.debt_before == debt and record.debt_refreshed == debt
    assert record.debt_after == session.debt == 0 and record.recomputed == debt
    reference = prefill(tiny_lm, torch.tensor(new))[0]
    assert max(max_abs_diff(session.cache, reference)) <= fp64_tol(reference)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(new=None), TypeError, "new is None"),
        (dict(new=[1, 2, "three"]), TypeError, r"new mixes kinds: new\[0\] is int \(ids\) but new\[2\] is str"),
        (dict(new=["text", 4]), TypeError, r"new mixes kinds: new\[0\] is str \(segments\) but new\[1\] is int"),
        (dict(new=[{"role": "user", "content": "hi"}, "text"]), TypeError, r"new mixes kinds.*new\[1\] is str"),
        (dict(new=[1, None]), TypeError, r"new mixes kinds.*new\[1\] is NoneType"),
        (dict(new=[True, False]), TypeError, r"new must be token ids.*new\[0\] is bool"),
        (dict(new={"role": "user"}), TypeError, "new must be token ids, text"),
        (dict(new=[{"role": "user", "content": "hi"}], template_kwargs="enable_thinking"), TypeError,
         "template_kwargs must be a dict"),
        (dict(new=[{"role": "user", "content": "hi"}], template_kwargs=[("a", 1)]), TypeError,
         "template_kwargs must be a dict"),
        (dict(new=[{"role": "user", "content": "hi"}], add_generation_prompt="yes"), TypeError,
         "add_generation_prompt must be True or False"),
    ],
)
def test_sync_checks_input_kinds_before_any_tensor(kwargs, error, match):
    session = _text_session()
    before = session.tokens.tolist(), len(session.history)
    with pytest.raises(error, match=match):
        session.sync(**kwargs)
    assert (session.tokens.tolist(), len(session.history)) == before


def test_chat_messages_are_located_by_rendering_the_conversation_prefix():
    tok = qwen_tokenizer()
    # The same text in several messages (the old fallback searched for it and could cut inside an earlier message);
    # consecutive tool results, which the Qwen2.5 template groups into one turn.
    messages = [{"role": "system", "content": "OK"}, {"role": "user", "content": "OK"},
                {"role": "tool", "content": "OK"}, {"role": "tool", "content": "OK"},
                {"role": "assistant", "content": "OK"}]
    segments = chat_segments(tok, messages)
    assert "".join(segments) == tok.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    assert len(segments) == len(messages) and all("OK" in seg for seg in segments)
    assert segments[2].endswith("</tool_response>") and segments[3].startswith("\n<tool_response>\nOK")
    for k in (1, 2, 4):  # where the prefix's rendering is a prefix of the whole, the cut is exactly its end
        head = tok.apply_chat_template(messages[:k], tokenize=False, enable_thinking=False)
        assert "".join(segments[:k]) == head


def test_a_template_that_renders_earlier_turns_differently_is_refused():
    import copy

    tok = copy.deepcopy(qwen_tokenizer())
    # Drops an assistant message's reasoning once another message follows (reasoning templates do).
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not "
                         "loop.last %}{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}"
                         "<|im_end|>\n{% endfor %}")
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>R</think>A"},
                {"role": "user", "content": "A"}]
    with pytest.raises(ValueError, match=r"not prefix-stable: it renders messages\[1\] \(role 'assistant'\)"):
        chat_segments(tok, messages)
    lm = dataclasses.replace(chat_lm(), tokenizer=tok)
    session = EditSession(lm)
    with pytest.raises(ValueError, match="new: tokenizer's chat template is not prefix-stable"):
        session.sync(messages)
    assert len(session) == 0
    assert len(chat_segments(tok, messages[:2])) == 2  # the last turn is rendered live: nothing to refuse


# ---------------------------------------------------------------------------------------------------------------------
# check_model, the gate


def _nomask_model(kind: str):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def ignores_the_mask(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001 - transformers' API
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=False, **kwargs)

    AttentionInterface.register("sur_lab_test_ignores_mask", ignores_the_mask)
    lm = make_tiny_model(kind)
    lm.model.config._attn_implementation = "sur_lab_test_ignores_mask"
    return lm


def _patched_rope_model(kind: str):
    """The model's RoPE runs at twice the positions the repair assumes (a scaling its config does not report)."""
    from sur_lab.models import rotary_embedding

    lm = make_tiny_model(kind)
    rotary = rotary_embedding(lm.model)
    original = rotary.forward
    rotary.forward = lambda x, position_ids: original(x, position_ids * 2)
    return lm


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_check_model_passes_on_the_tiny_models(kind):
    report = check_model(make_tiny_model(kind))
    assert isinstance(report, ModelCheckReport) and report.passed, str(report)
    assert {r.name for r in report.results} == {"shift_layer0", "full_budget", "packed:packed",
                                                "packed:packed-sdpa", "sync"}
    assert all(r.error <= r.tolerance for r in report.results)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("broken,fails", [(_patched_rope_model, {"shift_layer0"}),
                                          (_nomask_model, {"full_budget", "packed:packed", "packed:packed-sdpa",
                                                           "sync"})])
def test_check_model_fails_on_a_broken_model(kind, broken, fails):
    lm = broken(kind)
    with pytest.raises(ModelCheckError, match=sorted(fails)[0]) as raised:
        EditSession(lm, check=True)
    report = raised.value.report
    assert set(report.failures) == fails, str(report)
    assert all(r.error <= r.tolerance for r in report.results if r.name not in fails)
    if kind == "llama":
        with pytest.raises(ModelCheckError, match=sorted(fails)[0]):
            check_model(lm, strict=True)
        assert not check_model(lm).passed


def test_edit_session_checks_each_model_once(monkeypatch):
    import sur_lab.model_check as mc

    calls = []
    real = mc.check_model
    monkeypatch.setattr(mc, "check_model", lambda lm, **kw: calls.append(lm.model) or real(lm, **kw))
    lm, other = make_tiny_model("llama", seed=1), make_tiny_model("llama", seed=2)
    EditSession(lm, check=True)
    EditSession(lm, check=True).fork()
    EditSession(lm)
    assert calls == [lm.model]
    EditSession(other, check=True)
    assert calls == [lm.model, other.model]


@pytest.mark.parametrize("kwargs,error,match", [({"num_tokens": 8}, ValueError, "num_tokens"),
                                                ({"executors": ["nope"]}, ValueError, "executor"),
                                                ({}, TypeError, "lm_or_model")])
def test_check_model_refuses_bad_arguments(kwargs, error, match):
    target = "not a model" if not kwargs else tiny("llama")
    with pytest.raises(error, match=match):
        check_model(target, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_model_passes_on_smollm2(smol, dtype):
    import copy

    from sur_lab.models import wrap_model

    lm = smol if dtype == torch.float32 else wrap_model(copy.deepcopy(smol.model).to(dtype), smol.tokenizer)
    report = check_model(lm)
    assert report.passed, str(report)


@pytest.mark.slow
def test_the_agent_loop_example_in_the_docs_runs(smol, capsys):
    """The ``<!-- test: slow -->`` python block of docs/sessions.md, as a user would run it (it loads the embedded
    model)."""
    from test_docs import code_blocks

    from sur_lab.paths import REPO_ROOT

    blocks = [code for _, mode, code in code_blocks(REPO_ROOT / "docs" / "sessions.md", all_blocks=False)
              if mode == "slow"]
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/sessions.md", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    # the third sync: most rows after the compaction are new text, above SyncPolicy's max_new_share -> prefix reuse
    assert [line.split()[1] for line in lines[:3]] == ["tail", "tail", "prefix-reuse"]
    assert lines[3].split()[0] == "repair"
