"""The Erratum reference operator (issue 26): the Dirty cache kept whole plus a prefill of a correction note equals a
plain prefill of the original context followed by the note, in float64 on the tiny models; the input is unchanged;
the note's templates; refused inputs."""

from __future__ import annotations

import pytest
import torch

from conftest import fp64_tol, hf_prefill
from sur_lab.cache_ops import cache_length, caches_equal, clone_cache, to_tensors
from sur_lab.edits import splice_replacement, token_edit
from sur_lab.executors import (
    DEFAULT_ERRATUM,
    ErratumTemplates,
    dirty,
    erratum,
    erratum_note,
    pre_edit_ids,
)
from sur_lab.forward import prefill


def _ids(n, seed, vocab=96):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _max_diff(cache, oracle, rows):
    return max(
        max((k[:, :, rows] - ko[:, :, rows]).abs().max().item(), (v[:, :, rows] - vo[:, :, rows]).abs().max().item())
        for (k, v), (ko, vo) in zip(to_tensors(cache), oracle)
    )


@pytest.mark.parametrize("p,d,n", [(12, 7, 48), (0, 5, 30), (20, 8, 28)])  # middle, at the start, empty suffix
def test_erratum_is_a_prefill_of_the_original_context_and_the_note(tiny_lm, p, d, n):
    edit = token_edit(_ids(n, 1), p, d, _ids(5, 2))
    note = _ids(6, 3)
    dirty_cache = dirty(tiny_lm, edit)
    kept = clone_cache(dirty_cache)
    out = erratum(tiny_lm, dirty_cache, edit, note)
    assert cache_length(out) == n + 6
    oracle, _ = hf_prefill(tiny_lm, torch.cat((edit.original_ids, note)))
    tol = fp64_tol(*[t for kv in oracle for t in kv])
    assert _max_diff(out, oracle, slice(None)) <= tol
    # The Dirty rows are copies (deleted span included), not recomputations; the input is unchanged.
    for (k, v), (k0, v0) in zip(to_tensors(out), to_tensors(kept)):
        assert torch.equal(k[:, :, :n], k0) and torch.equal(v[:, :, :n], v0)
    assert caches_equal(dirty_cache, kept)


def test_erratum_of_a_replacement_extends_the_context_before_the_edit(tiny_lm):
    # The replacement layout: before ⊕ new ⊕ old ⊕ after, prefix ending with the m = 4 inserted tokens.
    before_edit = _ids(40, 4)
    new = _ids(4, 5)
    original, p, d = splice_replacement(before_edit, 15, 22, new)
    edit = token_edit(original, p, d, _ids(5, 6))
    assert torch.equal(pre_edit_ids(edit, 4), before_edit)
    note = _ids(7, 7)
    out = erratum(tiny_lm, prefill(tiny_lm, before_edit)[0], edit, note, inserted_len=4)
    assert cache_length(out) == 40 + 7
    oracle, _ = hf_prefill(tiny_lm, torch.cat((before_edit, note)))
    assert _max_diff(out, oracle, slice(None)) <= fp64_tol(*[t for kv in oracle for t in kv])


def test_erratum_refuses_bad_inputs_before_any_forward(tiny_lm):
    edit = token_edit(_ids(30, 1), 10, 5, _ids(4, 2))
    cache = dirty(tiny_lm, edit)
    with pytest.raises(ValueError, match="dirty_cache has 30 rows"):
        erratum(tiny_lm, cache, edit, _ids(3, 3), inserted_len=2)
    with pytest.raises(ValueError, match="note_ids"):
        erratum(tiny_lm, cache, edit, torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="note_ids"):
        erratum(tiny_lm, cache, edit, torch.tensor([1, 96]))
    with pytest.raises(TypeError, match="note_ids"):
        erratum(tiny_lm, cache, edit, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="inserted_len=11 exceeds"):
        erratum(tiny_lm, cache, edit, _ids(3, 3), inserted_len=11)
    with pytest.raises(TypeError, match="inserted_len"):
        pre_edit_ids(edit, 1.0)
    assert cache_length(cache) == 30


@pytest.fixture(scope="module")
def tok():
    from sur_lab.models import embedded_tokenizer

    try:
        return embedded_tokenizer()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {err}")


def test_notes_name_the_withdrawn_passage_or_give_the_new_text(tok):
    from sur_lab.edits import replacement_edit, segment_edit

    old = "Service record: the deploy target for service ledger-api is onyx-12.\n\n"
    new = "Service record: the deploy target for service ledger-api is vega-31.\n\n"
    deletion = segment_edit(tok, ["Notes:\n\n"], old, ["Title: A\nText."], "\n\nQuestion: q?")
    note = erratum_note(deletion)
    assert note == '\n\nCorrection: the passage above that begins "Service record: the deploy target for..." is ' \
                   "withdrawn. Disregard it."
    assert "onyx-12" not in note
    repl = replacement_edit(tok, ["Notes:\n\n"], old, new, ["Title: A\nText."], "\n\nQuestion: q?")
    m = len(tok(new, add_special_tokens=False)["input_ids"])
    update = erratum_note(repl, inserted_len=m)
    assert update == "\n\nCorrection, this supersedes the notes above: " + new.strip()
    custom = ErratumTemplates(update="\n\nNOTE: {inserted} (was: {excerpt})", excerpt_words=2)
    assert erratum_note(repl, inserted_len=m, templates=custom) == f"\n\nNOTE: {new.strip()} (was: Service record:...)"
    assert DEFAULT_ERRATUM == ErratumTemplates()


def test_note_templates_are_checked():
    with pytest.raises(ValueError, match="excerpt_words"):
        ErratumTemplates(excerpt_words=0)
    with pytest.raises(ValueError, match="deletion"):
        ErratumTemplates(deletion="  ")
    with pytest.raises(ValueError, match="update=.*field"):
        ErratumTemplates(update="{value}")
    with pytest.raises(ValueError, match="no text"):
        erratum_note(token_edit(_ids(10, 1), 2, 3, _ids(2, 2)))
