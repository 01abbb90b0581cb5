"""Prefix-conditioned composition of document caches (SAFE-KV Fig. 1) and its bridge to the deletion executors.

Exactness: the shared prefix is prefilled once and every path continues from it, so composing one document, re-encoding
every document row (suffix repair from the first document) and donor-copying every row reproduce full prefill
*bitwise*, in any dtype. Where two computations differ only by how tokens are chunked into forwards (document 0 alone
vs all documents in one forward), float64 reassociation leaves ~1e-15; the tolerance 1e-10 is the float64-RoPE
exactness level of conftest's tiny models.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from sur_lab.budget import Support
from sur_lab.cache_ops import caches_equal, max_abs_diff, rerotate_keys, to_tensors
from sur_lab.studies.noprefix import (
    PLACEHOLDER_TOKEN,
    build_caches,
    compose_cache,
    compose_prompt,
    compose_tokens,
    composition_edit,
    document_caches,
    prefix_cache,
)
from sur_lab.data.text import truncate_text
from sur_lab.executors import EXECUTORS, check_support, get_executor
from sur_lab.answer import greedy_answer
from sur_lab.studies.noprefix import donor_copy, run_protocol, suffix_support

CHUNKING_TOL = 1e-10


def random_prompt(doc_lens=(7, 5, 9), prefix_len=6, query_len=4, seed=1, vocab=96):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g)  # noqa: E731
    return compose_tokens(ids(prefix_len), [ids(n) for n in doc_lens], ids(query_len))


def test_single_document_composition_equals_full_prefill(tiny_lm):
    prompt = random_prompt(doc_lens=(11,))
    caches = build_caches(tiny_lm, prompt)
    assert caches_equal(caches.composed, caches.full)
    a = greedy_answer(tiny_lm, caches.composed, prompt.query_ids, max_new_tokens=5)
    b = greedy_answer(tiny_lm, caches.full, prompt.query_ids, max_new_tokens=5)
    assert torch.equal(a.first_token_logits, b.first_token_logits)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("doc_lens", [(7, 5), (7, 5, 9), (3, 4, 5, 6)])
def test_composition_without_repair_differs_from_full_prefill(tiny_lm, doc_lens):
    prompt = random_prompt(doc_lens=doc_lens)
    caches = build_caches(tiny_lm, prompt)
    p, (a1, _) = prompt.prefix_len, prompt.doc_bounds[1]
    # The first document's composed rows are its full-prefill rows (same history); later ones lack predecessors.
    first = slice(p, p + a1)
    assert max(max_abs_diff(caches.composed, caches.full, first)) < CHUNKING_TOL
    later = slice(p + a1, p + prompt.suffix_len)
    assert max(max_abs_diff(caches.composed, caches.full, later)) > 1e-3
    a = greedy_answer(tiny_lm, caches.composed, prompt.query_ids, max_new_tokens=1)
    b = greedy_answer(tiny_lm, caches.full, prompt.query_ids, max_new_tokens=1)
    assert (a.first_token_logits - b.first_token_logits).abs().max() > 1e-4


def test_composed_rows_are_rerotated_document_rows():
    lm = make_tiny_model("llama")
    prompt = random_prompt()
    prefix = prefix_cache(lm, prompt)
    docs = document_caches(lm, prompt, prefix)
    composed = compose_cache(lm, prompt, prefix, docs)
    p = prompt.prefix_len
    for i, ((a, b), doc) in enumerate(zip(prompt.doc_bounds, docs)):
        for (kc, vc), (kd, vd), (kp, vp) in zip(to_tensors(composed), to_tensors(doc), to_tensors(prefix)):
            want = kd if a == 0 else rerotate_keys(kd, a, lm.inv_freq)
            assert torch.equal(kc[:, :, p + a : p + b], want), f"document {i} keys"
            assert torch.equal(vc[:, :, p + a : p + b], vd), f"document {i} values"
            assert torch.equal(kc[:, :, :p], kp) and torch.equal(vc[:, :, :p], vp)


def test_suffix_repair_from_first_document_equals_full_prefill(tiny_lm):
    prompt = random_prompt()
    caches = build_caches(tiny_lm, prompt)
    edit = composition_edit(prompt)
    repaired, _ = run_protocol(tiny_lm, caches, edit, suffix_support(prompt, 0), "forward", "sequential")
    assert caches_equal(repaired, caches.full)
    assert not caches_equal(caches.composed, caches.full)


def test_suffix_repair_from_second_document_matches_full_prefill_to_rounding(tiny_lm):
    # The first document's composed state is exact, so the suffix from document 1 restores every stale row.
    prompt = random_prompt()
    caches = build_caches(tiny_lm, prompt)
    repaired, _ = run_protocol(tiny_lm, caches, composition_edit(prompt), suffix_support(prompt, 1))
    assert max(max_abs_diff(repaired, caches.full)) < CHUNKING_TOL


def test_suffix_repair_from_later_start_leaves_earlier_rows_stale():
    lm = make_tiny_model("llama")
    prompt = random_prompt(doc_lens=(6, 5, 7, 4))
    caches = build_caches(lm, prompt)
    repaired, _ = run_protocol(lm, caches, composition_edit(prompt), suffix_support(prompt, 2))
    p, (a2, _) = prompt.prefix_len, prompt.doc_bounds[2]
    kept = slice(0, p + a2)
    assert max(max_abs_diff(repaired, caches.composed, kept)) == 0.0
    assert max(max_abs_diff(repaired, caches.full, slice(p + prompt.doc_bounds[1][0], p + a2))) > 1e-3


def test_donor_copy_of_every_row_equals_full_prefill(tiny_lm):
    prompt = random_prompt()
    caches = build_caches(tiny_lm, prompt)
    copied = donor_copy(caches.composed, caches.full, prompt.prefix_len, Support.full(prompt.suffix_len))
    assert caches_equal(copied, caches.full)
    via_protocol, _ = run_protocol(tiny_lm, caches, composition_edit(prompt), Support.full(prompt.suffix_len), "donor")
    assert caches_equal(via_protocol, caches.full)


def test_donor_copy_writes_only_the_support():
    lm = make_tiny_model("llama")
    prompt = random_prompt()
    caches = build_caches(lm, prompt)
    support = Support.from_unsorted([2, 3, 4, 10, 11], prompt.suffix_len)
    out = donor_copy(caches.composed, caches.full, prompt.prefix_len, support)
    p = prompt.prefix_len
    mask = torch.zeros(p + prompt.suffix_len, dtype=torch.bool)
    mask[torch.as_tensor(support.absolute(p))] = True
    for (ko, vo), (kc, vc), (kf, vf) in zip(to_tensors(out), to_tensors(caches.composed), to_tensors(caches.full)):
        assert torch.equal(ko[:, :, mask], kf[:, :, mask]) and torch.equal(vo[:, :, mask], vf[:, :, mask])
        assert torch.equal(ko[:, :, ~mask], kc[:, :, ~mask]) and torch.equal(vo[:, :, ~mask], vc[:, :, ~mask])


def test_inputs_are_not_modified():
    lm = make_tiny_model("llama")
    prompt = random_prompt()
    caches = build_caches(lm, prompt)
    before = [(k.clone(), v.clone()) for k, v in to_tensors(caches.composed)]
    run_protocol(lm, caches, composition_edit(prompt), suffix_support(prompt, 1))
    donor_copy(caches.composed, caches.full, prompt.prefix_len, suffix_support(prompt, 1))
    for (k, v), (k0, v0) in zip(to_tensors(caches.composed), before):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_composition_edit_is_accepted_by_executors():
    prompt = random_prompt()
    edit = composition_edit(prompt)
    assert torch.equal(edit.edited_ids, prompt.ids)
    assert (edit.prefix_len, edit.suffix_len, edit.deleted_len) == (prompt.prefix_len, prompt.suffix_len, 1)
    assert int(edit.original_ids[prompt.prefix_len]) == PLACEHOLDER_TOKEN
    assert torch.equal(edit.query_ids, prompt.query_ids)
    lm = make_tiny_model("llama")
    caches = build_caches(lm, prompt)
    check_support(edit, Support.full(prompt.suffix_len), caches.composed)


@pytest.mark.parametrize("name", ["packed", "direct-sequential"])
def test_packed_executors_repair_the_composed_cache(name):
    get_executor("sequential")  # imports sur_lab.executors.packed when present
    if name not in EXECUTORS:
        pytest.skip(f"executor {name!r} is not registered")
    lm = make_tiny_model("llama")
    prompt = random_prompt(doc_lens=(6, 5, 7, 4))
    caches = build_caches(lm, prompt)
    edit = composition_edit(prompt)
    support = Support.from_unsorted([*range(5, 9), *range(14, 20)], prompt.suffix_len)
    ref, _ = run_protocol(lm, caches, edit, support, "forward", "sequential")
    out, _ = run_protocol(lm, caches, edit, support, "forward", name)
    assert max(max_abs_diff(out, ref)) < CHUNKING_TOL


def test_errors():
    lm = make_tiny_model("llama")
    with pytest.raises(ValueError, match="documents"):
        compose_tokens([1, 2], [], [3])
    with pytest.raises(ValueError, match="doc_ids"):
        compose_tokens([1, 2], [[4, 5], []], [3])
    with pytest.raises(ValueError, match="prefix_ids"):
        compose_tokens([], [[4, 5]], [3])
    with pytest.raises(ValueError, match="query_ids"):
        compose_tokens([1], [[4, 5]], [])
    with pytest.raises(ValueError, match="supporting"):
        compose_tokens([1], [[4, 5]], [3], supporting=[True, False])
    with pytest.raises(ValueError, match="documents"):
        compose_prompt(None, [], "a question?")
    prompt = random_prompt()
    prefix = prefix_cache(lm, prompt)
    docs = document_caches(lm, prompt, prefix)
    with pytest.raises(ValueError, match="doc_kv"):
        compose_cache(lm, prompt, prefix, docs[:-1])
    with pytest.raises(ValueError, match="prefix_kv"):
        compose_cache(lm, prompt, docs[0], docs)
    for start in (-1, prompt.num_docs, 1.5):
        with pytest.raises(ValueError, match="start"):
            suffix_support(prompt, start)


@pytest.mark.slow
def test_compose_prompt_on_the_embedded_model(smol):
    from sur_lab.edits import render_chat, format_passages

    passages = [("Alpha", "Alpha is a river in Norway. It is long.", True), ("Beta", "Beta is a town.", False),
                ("Gamma", "Gamma was founded in 1901 by settlers. It grew quickly after the railway came.", False)]
    prompt = compose_prompt(smol.tokenizer, passages, "Where is Alpha?")
    documents, _ = format_passages([(t, x) for t, x, _ in passages])
    text, query_text, _, _ = render_chat(smol.tokenizer, documents, "Where is Alpha?")
    assert prompt.text + prompt.query_text == text + query_text
    assert prompt.supporting == (True, False, False) and prompt.titles == ("Alpha", "Beta", "Gamma")
    # Offsets cover the pre-query text in order, one span per token.
    assert len(prompt.offsets) == prompt.prefix_len + prompt.suffix_len
    assert prompt.offsets[-1][1] == len(prompt.text)
    starts = [a for a, _ in prompt.offsets]
    assert starts == sorted(starts)
    # Each document segment tokenizes to its ids on its own: the document cache store's contract.
    for seg, ids in zip(prompt.doc_texts, prompt.doc_ids):
        assert smol.tokenizer(seg, add_special_tokens=False)["input_ids"] == ids.tolist()
    one = compose_prompt(smol.tokenizer, passages[:1], "Where is Alpha?")
    caches = build_caches(smol, one)
    assert caches_equal(caches.composed, caches.full)
    # Whole sentences are kept while they fit; below one sentence the text is cut at a token boundary.
    sentence = "Gamma was founded in 1901 by settlers."
    cap = len(smol.tokenizer(f"Title: Gamma\n{sentence}", add_special_tokens=False)["input_ids"])
    assert truncate_text(smol.tokenizer, "Gamma", passages[2][1], cap) == sentence
    cut = truncate_text(smol.tokenizer, "Gamma", passages[2][1], cap - 1)
    assert sentence.startswith(cut) and len(cut) < len(sentence)
    assert len(smol.tokenizer(f"Title: Gamma\n{cut}", add_special_tokens=False)["input_ids"]) <= cap - 1


def test_document_store_reuses_caches_and_changes_nothing(tiny_lm):
    prompt = random_prompt()
    store: dict = {}
    first = build_caches(tiny_lm, prompt, doc_store=store)
    assert len(store) == len(prompt.doc_ids)
    cached = dict(store)
    again = build_caches(tiny_lm, prompt, doc_store=store)
    assert all(store[k] is cached[k] for k in cached)  # nothing re-encoded
    plain = build_caches(tiny_lm, prompt)
    for c in (first, again):
        assert caches_equal(c.composed, plain.composed) and caches_equal(c.full, plain.full)
