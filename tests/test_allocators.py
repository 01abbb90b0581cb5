"""The fourteen allocators: exact-B supports, and each Table 1 signal against an independent computation.

Attention-derived signals are checked against transformers' own eager attention (``output_attentions=True``) on a
float64 tiny model. Eager attention takes its softmax in float32 whatever the model dtype (``softmax(...,
dtype=torch.float32)`` in ``eager_attention_forward``), so the reference carries float32 rounding (~6e-8 relative,
compounding over 3 layers) while the probe computes in float64: the tolerance is ``EAGER_RTOL`` = 1e-6. FP32 signals
(CacheTune) use 1e-5; float64-only paths use 1e-10 or tighter.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import make_tiny_model
from sur_lab.allocators import ALLOCATORS, AllocationRequest, allocate, top_b
from sur_lab.allocators import controls, prior, signals
from sur_lab.budget import allowance, fractions_expected
from sur_lab.cache_ops import clone_cache, layer_kv, num_layers
from sur_lab.edits import chat_edit, token_edit
from sur_lab.executors import reprefill
from sur_lab.repair import prepare
from sur_lab.studies.niah import PAPER_ALLOCATORS

#: Reference error of eager attention's float32 softmax (see the module docstring).
EAGER_RTOL = 1e-6

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def char_tokenizer():
    """A character-level fast tokenizer over newline + printable ASCII (96 ids, the tiny models' vocabulary) with a
    plain-text chat template, so text edits, offsets and units work on tiny models."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["\n"] + [chr(c) for c in range(32, 127)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="~"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = CHAT_TEMPLATE
    return fast


DOCS = (
    "Title: Alpha\nThe river bank is wide. Magic numbers live here, said the river.\n\n"
    "Title: Beta\nOne of the special magic numbers for quiet-river is: 4821937.\n\n"
    "Title: Gamma\nA quiet river runs through it. Numbers are magic. The end came late.\n\n"
    "Title: Delta\nOne of the special magic numbers for quiet-river is: 7310462."
)
QUESTION = "What are all the special magic numbers for quiet-river?"


def text_edit(tokenizer):
    start = DOCS.index("Title: Beta")
    return chat_edit(tokenizer, DOCS, QUESTION, (start, DOCS.index("Title: Gamma")))


def random_edit(seed: int, prefix: int, deleted: int, suffix: int, query: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (prefix + deleted + suffix,), generator=g)
    return token_edit(ids, prefix, deleted, torch.randint(0, 96, (query,), generator=g))


def eager_copy(kind: str):
    """The same tiny model (same seed, hence weights) with transformers' eager attention, for output_attentions."""
    lm = make_tiny_model(kind)
    lm.model.set_attn_implementation("eager")
    return lm


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def text_lm():
    return dataclasses.replace(make_tiny_model("llama"), tokenizer=char_tokenizer())


def test_every_paper_allocator_is_registered():
    assert set(PAPER_ALLOCATORS) <= set(ALLOCATORS)
    assert len(PAPER_ALLOCATORS) == 14


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prefix=st.integers(0, 12),
    deleted=st.integers(1, 8),
    suffix=st.integers(1, 140),
    seed=st.integers(0, 2**16),
)
@example(prefix=0, deleted=1, suffix=1, seed=0)
def test_every_allocator_returns_exactly_b_unique_suffix_positions(llama, prefix, deleted, suffix, seed):
    edit = random_edit(seed, prefix, deleted, suffix)
    prepared = prepare(llama, edit)
    for name in PAPER_ALLOCATORS:
        for b in (0, 2, 5, 37, 100):
            request = AllocationRequest(
                llama, edit, b, shift_cache=prepared.shift_cache, seed=seed,
                options={"dirty_cache": prepared.dirty_cache},
            )
            selection = allocate(name, request)
            pos = selection.support.positions
            assert len(pos) == allowance(suffix, b) == len(np.unique(pos)), (name, b)
            assert len(pos) == 0 or (pos.min() >= 0 and pos.max() < suffix), (name, b)
            assert selection.extra_forward_tokens >= 0


def test_text_edit_allocators_return_exact_b(text_lm):
    edit = text_edit(text_lm.tokenizer)
    prepared = prepare(text_lm, edit)
    for name in PAPER_ALLOCATORS:
        # The auxiliary model is given so the test does not load the embedded default.
        request = AllocationRequest(text_lm, edit, 13, shift_cache=prepared.shift_cache, options={"aux_model": text_lm})
        assert allocate(name, request).support.size == allowance(edit.suffix_len, 13), name


# ---------------------------------------------------------------------------------------------------------------------
# Matched controls


def _top_b_brute(scores, b):
    """Oracle for the top-B rule: repeatedly take the highest remaining score, the earliest index among equals."""
    left, chosen = list(range(len(scores))), []
    for _ in range(b):
        best = left[0]
        for i in left[1:]:
            if scores[i] > scores[best]:
                best = i
        chosen.append(best)
        left.remove(best)
    return sorted(chosen)


def _window_brute(scores, width):
    """Oracle for the best window: exact sums (Fraction) of every window, earliest maximizer."""
    from fractions import Fraction

    sums = [sum(Fraction(float(x)) for x in scores[s : s + width]) for s in range(len(scores) - width + 1)]
    return sums.index(max(sums))


@settings(max_examples=40, deadline=None)
@given(scores=st.lists(st.integers(-3, 3), min_size=1, max_size=40), data=st.data())
def test_top_b_matches_brute_force_with_ties(scores, data):
    b = data.draw(st.integers(0, len(scores)))
    assert top_b(np.array(scores, dtype=np.float32), b).tolist() == _top_b_brute(scores, b)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), suffix=st.integers(1, 120), budget=st.sampled_from([1, 5, 20, 37, 99]))
def test_dense_tokens_is_the_brute_force_top_b_of_eq7_scores(llama, seed, suffix, budget):
    edit = random_edit(seed, 10, 5, suffix)
    selection = allocate("Dense tokens", AllocationRequest(llama, edit, budget))
    # Eq. 7 recomputed here in float64 from the embedding table: max cosine to a query token + 0.25 if identical.
    E = llama.model.get_input_embeddings().weight.double()
    s = torch.nn.functional.normalize(E[edit.suffix_ids], dim=-1)
    q = torch.nn.functional.normalize(E[edit.relevance_ids], dim=-1)
    scores = ((s @ q.T).amax(dim=1) + 0.25 * torch.isin(edit.suffix_ids, edit.relevance_ids).double()).tolist()
    B = allowance(suffix, budget)
    expected = _top_b_brute(scores, B)
    got = selection.support.positions.tolist()
    if got != expected:
        # The allocator scores in float32 (Eq. 7 as specified): only near-ties within float32 rounding may differ.
        eps = 8 * float(np.finfo(np.float32).eps)
        cut = sorted(scores, reverse=True)[B - 1]
        assert all(abs(scores[i] - cut) <= eps for i in set(got) ^ set(expected)), (got, expected)
    assert len(got) == B


@settings(max_examples=60, deadline=None)
@given(scores=st.lists(st.integers(-4, 4), min_size=1, max_size=60), data=st.data())
def test_max_sum_window_matches_brute_force_and_takes_earliest_tie(scores, data):
    width = data.draw(st.integers(1, len(scores)))
    arr = np.array(scores, dtype=np.float64) / 8  # exact in binary: sums compare exactly in both computations
    assert controls.max_sum_window(arr, width) == _window_brute(arr, width)


def test_max_sum_window_refuses_a_bad_width():
    with pytest.raises(ValueError, match="width"):
        controls.max_sum_window(np.zeros(5), 0)
    with pytest.raises(ValueError, match="width"):
        controls.max_sum_window(np.zeros(5), 6)


def test_max_relevance_contiguous_is_the_brute_force_best_window(llama):
    edit = random_edit(2, 4, 3, 60)
    request = AllocationRequest(llama, edit, 10)
    selection = allocate("Max-relevance contiguous", request)
    start = _window_brute(selection.diagnostics["token_scores"], 6)
    assert selection.support.positions.tolist() == list(range(start, start + 6))
    assert selection.support.num_intervals == 1


def test_bm25_terms_are_lowercase_ascii_alphanumeric():
    assert controls.bm25_terms("Hello, WORLD! café 42 x_y") == ["hello", "world", "caf", "42", "x", "y"]


def test_bm25_scores_match_hand_computation_on_three_units():
    docs = [["magic", "number", "river"], ["river", "river", "bank"], ["number"]]
    query = ["river", "number", "river", "absent"]
    k1, b, n, avgdl = 1.2, 0.75, 3, 7 / 3
    idf = math.log(1 + (n - 2 + 0.5) / (2 + 0.5))  # df(river) = df(number) = 2

    def tf(f, dl):
        return f / (f + k1 * (1 - b + b * dl / avgdl))

    expected = [
        2 * idf * tf(1, 3) + idf * tf(1, 3),  # river counts twice (query multiplicity)
        2 * idf * tf(2, 3),
        idf * tf(1, 1),
    ]
    np.testing.assert_allclose(controls.bm25_scores(query, docs), expected, rtol=1e-12)
    assert controls.bm25_scores(["absent"], docs).tolist() == [0.0, 0.0, 0.0]


def _bm25_textbook(query, docs, k1=1.2, b=0.75):
    """Oracle: BM25 written out term by term (Lucene idf, query-term multiplicity), in exact fractions where possible."""
    from fractions import Fraction

    n = len(docs)
    avgdl = Fraction(sum(len(d) for d in docs), n)
    scores = []
    for d in docs:
        total = 0.0
        for t in query:
            f = d.count(t)
            df = sum(t in other for other in docs)
            if f == 0 or df == 0:
                continue
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            norm = Fraction(k1) * (1 - Fraction(b) + Fraction(b) * len(d) / avgdl)
            total += idf * float(Fraction(f) / (f + norm))
        scores.append(total)
    return scores


@settings(max_examples=40, deadline=None)
@given(
    docs=st.lists(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=12), min_size=1, max_size=6),
    query=st.lists(st.sampled_from("abcdefgxy"), min_size=1, max_size=6),
)
def test_bm25_scores_match_a_textbook_bm25(docs, query):
    np.testing.assert_allclose(controls.bm25_scores(query, docs), _bm25_textbook(query, docs), rtol=1e-9, atol=1e-12)


def test_bm25_allocator_scores_sur_units_by_their_text(text_lm):
    edit = text_edit(text_lm.tokenizer)
    request = AllocationRequest(text_lm, edit, 30)
    selection = allocate("BM25 (same units)", request)
    units = selection.diagnostics["units"]
    p, text, off = edit.prefix_len, edit.edited_text, edit.edited_offsets
    docs = [controls.bm25_terms(text[off[p + u.start][0] : off[p + u.end - 1][1]]) for u in units]
    np.testing.assert_allclose(
        selection.diagnostics["unit_scores"], controls.bm25_scores(controls.bm25_terms(QUESTION), docs), rtol=1e-12
    )
    best = units[int(np.argmax(selection.diagnostics["unit_scores"]))]
    B = request.allowance
    if len(best) <= B:
        assert set(range(best.start, best.end)) <= set(selection.support.positions.tolist())
    else:  # a flat (broadcast) envelope puts the window at the unit's start
        assert selection.support.positions.tolist() == list(range(best.start, best.start + B))


def test_random_semantic_units_admits_whole_units_and_one_window(llama):
    edit = random_edit(3, 5, 4, 400)
    prepared = prepare(llama, edit)
    request = AllocationRequest(llama, edit, 40, shift_cache=prepared.shift_cache, seed=11)
    sel = allocate("Random semantic units", request)
    again = allocate("Random semantic units", AllocationRequest(llama, edit, 40, seed=11))
    other = allocate("Random semantic units", AllocationRequest(llama, edit, 40, seed=12))
    pos = sel.support.positions.tolist()
    assert pos == again.support.positions.tolist() and pos != other.support.positions.tolist()
    units, d = sel.diagnostics["units"], sel.diagnostics
    expected = set()
    for idx in d["admitted"]:
        expected |= set(range(units[idx].start, units[idx].end))
    assert d["admitted"] == [int(i) for i in d["order"][: len(d["admitted"])]]
    part = units[d["partial"]]
    width = 160 - len(expected)
    assert part.start <= d["window_start"] <= part.end - width
    expected |= set(range(d["window_start"], d["window_start"] + width))
    assert sel.support.positions.tolist() == sorted(expected)


# ---------------------------------------------------------------------------------------------------------------------
# Attention-derived signals against eager attention


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_prophetkv_and_infoflow_are_query_attention_mean_and_l2(kind):
    lm, eager = make_tiny_model(kind), eager_copy(kind)
    edit = random_edit(4, 20, 6, 70, query=7)
    p, S, Q = edit.prefix_len, edit.suffix_len, 7
    prepared = prepare(lm, edit)
    mean, l2, n = prior.query_attention_stats(lm, prepared.shift_cache, edit)
    work = clone_cache(prepared.shift_cache)
    out = eager.model(
        input_ids=edit.query_ids[None], cache=work, position_ids=torch.arange(p + S, p + S + Q)[None],
        use_cache=True, output_attentions=True,
    )
    att = torch.stack(out.attentions)[:, 0, :, :, p : p + S]  # (L, H, Q, S)
    assert n == Q
    np.testing.assert_allclose(mean, att.mean(dim=(0, 1, 2)).numpy(), rtol=EAGER_RTOL, atol=1e-12)
    np.testing.assert_allclose(l2, att.square().sum(dim=(0, 1, 2)).sqrt().numpy(), rtol=EAGER_RTOL, atol=1e-12)
    request = AllocationRequest(lm, edit, 10, shift_cache=prepared.shift_cache)
    assert allocate("ProphetKV-Adapted", request).support.positions.tolist() == top_b(mean, 7).tolist()
    assert allocate("InfoFlow-Motivated", request).support.positions.tolist() == top_b(l2, 7).tolist()
    assert allocate("ProphetKV-Adapted", request).extra_forward_tokens == Q


def test_attention_probe_forms_only_the_forwarded_rows(llama):
    edit = random_edit(5, 10, 3, 50, query=4)
    prepared = prepare(llama, edit)
    work = clone_cache(prepared.shift_cache)
    shapes = []
    with signals.attention_probe(llama, work, lambda l, a: shapes.append((l, tuple(a.shape)))):
        signals.forward_layers(llama, edit.query_ids, work)
    assert shapes == [(l, (4, 4, 64)) for l in range(3)]  # (H_Q, Q rows, p + S + Q keys), never (N, N)


@pytest.mark.parametrize("with_dirty", [True, False])
def test_cache_craft_is_attention_mass_on_deleted_keys(with_dirty):
    lm, eager = make_tiny_model("qwen3"), eager_copy("qwen3")
    edit = random_edit(6, 15, 9, 150)
    p, d = edit.prefix_len, edit.deleted_len
    prepared = prepare(lm, edit)
    scores, cost = prior.deleted_attention_mass(
        lm, edit, prepared.shift_cache, prepared.dirty_cache if with_dirty else None
    )
    out = eager.model(input_ids=edit.original_ids[None], output_attentions=True)
    att = torch.stack(out.attentions)[:, 0]  # (L, H, N, N): reference only, on a tiny model
    expected = att[:, :, p + d :, p : p + d].sum(-1).mean(dim=(0, 1))
    np.testing.assert_allclose(scores, expected.numpy(), rtol=EAGER_RTOL, atol=1e-12)
    assert cost == edit.suffix_len + (0 if with_dirty else d)


def test_cacheblend_scores_layer1_kv_deviation(llama):
    edit = random_edit(7, 12, 6, 80)
    p = edit.prefix_len
    prepared = prepare(llama, edit)
    clean = reprefill(llama, edit)
    (k_c, v_c), (k_s, v_s) = layer_kv(clean, 1), layer_kv(prepared.shift_cache, 1)
    expected = (k_c - k_s)[0, :, p:].square().sum(dim=(0, 2)) + (v_c - v_s)[0, :, p:].square().sum(dim=(0, 2))
    scores = prior.kv_deviation_layer1(llama, edit, prepared.shift_cache)
    np.testing.assert_allclose(scores, expected.numpy(), rtol=1e-12, atol=1e-20)
    sel = allocate("CacheBlend-Adapted", AllocationRequest(llama, edit, 10, shift_cache=prepared.shift_cache))
    assert sel.support.positions.tolist() == top_b(expected.numpy(), 8).tolist()
    assert (sel.extra_forward_tokens, sel.diagnostics["extra_forward_layers"]) == (p + 80, 2)


def test_shallow_prefill_holds_exactly_two_layers_equal_to_full_prefill(llama):
    edit = random_edit(8, 5, 2, 30)
    shallow = prior.shallow_prefill(llama, edit.edited_ids)
    full = reprefill(llama, edit)
    assert num_layers(shallow) == 2
    for layer in range(2):
        for a, b in zip(layer_kv(shallow, layer), layer_kv(full, layer)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a3_sums_layer1_query_attention(kind):
    lm, eager = make_tiny_model(kind), eager_copy(kind)
    edit = random_edit(9, 10, 4, 60, query=6)
    p, S = edit.prefix_len, edit.suffix_len
    scores = prior.shallow_query_attention(lm, edit)
    from transformers import DynamicCache

    cache = DynamicCache()
    eager.model(input_ids=edit.edited_ids[None], cache=cache, use_cache=True)
    out = eager.model(
        input_ids=edit.query_ids[None], cache=cache, position_ids=torch.arange(p + S, p + S + 6)[None],
        use_cache=True, output_attentions=True,
    )
    expected = out.attentions[1][0, :, :, p : p + S].sum(dim=(0, 1))
    np.testing.assert_allclose(scores, expected.numpy(), rtol=EAGER_RTOL, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# Geometry, spectrum and state signals


def test_legolink_ranks_by_depth_then_chunk_index():
    assert prior.legolink_order(7, chunk=3).tolist() == [0, 3, 6, 1, 4, 2, 5]
    order = prior.legolink_order(1100)
    assert order[:7].tolist() == [0, 512, 1024, 1, 513, 1025, 2]
    assert order[-1] == 1023  # depth 511 of chunk 2 (chunk 3 holds only 76 positions)


def test_legolink_allocator_takes_the_first_b_ranked(llama):
    edit = random_edit(10, 3, 2, 1100)
    with fractions_expected():  # 0.5 % is meant: B = ceil(1100 * 0.5 / 100) = 6
        sel = allocate("LegoLink-Adapted", AllocationRequest(llama, edit, 0.5))
    assert sel.support.positions.tolist() == [0, 1, 512, 513, 1024, 1025]  # B = ceil(5.5) = 6


@pytest.mark.parametrize("S,keep", [(1, 0), (2, 1), (3, 1), (5, 1), (6, 2), (10, 3), (11, 3), (64, 16)])
def test_cachetune_keeps_floor_half_of_the_rfft_bins(S, keep):
    assert prior.kept_rfft_bins(S) == keep == math.floor(0.5 * (S // 2 + 1))
    x = torch.randn(2, S, 4, dtype=torch.float64)
    y = prior.lowpass(x, dim=1)
    assert y.dtype == torch.float32 and y.shape == x.shape
    X, Y = torch.fft.rfft(x, dim=1), torch.fft.rfft(y.double(), dim=1)
    torch.testing.assert_close(Y[:, :keep], X[:, :keep].to(Y.dtype), rtol=1e-5, atol=1e-5)
    assert Y[:, keep:].abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_unrotate_keys_recovers_prerope_layer0_keys(kind):
    lm = make_tiny_model(kind)
    edit = random_edit(11, 9, 4, 40)
    p = edit.prefix_len
    shift = prepare(lm, edit).shift_cache
    attn = lm.model.model.layers[0].self_attn
    h = lm.model.model.layers[0].input_layernorm(lm.model.model.embed_tokens(edit.suffix_ids))
    k = attn.k_proj(h).view(40, -1, 16)
    k = attn.k_norm(k) if hasattr(attn, "k_norm") else k
    got = prior.unrotate_keys(layer_kv(shift, 0)[0][0, :, p:], torch.arange(p, p + 40), lm.inv_freq)
    torch.testing.assert_close(got, k.transpose(0, 1).float(), rtol=1e-5, atol=1e-5)


def test_cachetune_score_is_layer_normalized_mean_lowpass_norm(llama):
    edit = random_edit(12, 6, 3, 33)
    p, S = edit.prefix_len, edit.suffix_len
    shift = prepare(llama, edit).shift_cache
    keep = (S // 2 + 1) // 2
    expected = np.zeros(S)
    for layer in range(3):
        k, v = layer_kv(shift, layer)
        keys = prior.unrotate_keys(k[0, :, p:], torch.arange(p, p + S), llama.inv_freq).double().numpy()
        norms = []
        for x in (keys, v[0, :, p:].double().numpy()):
            spec = np.fft.rfft(x, axis=1)
            spec[:, keep:] = 0
            norms.append(np.linalg.norm(np.fft.irfft(spec, n=S, axis=1), axis=-1))
        per_pos = np.concatenate(norms).mean(axis=0)
        expected += per_pos / per_pos.sum() / 3
    np.testing.assert_allclose(prior.lowpass_kv_scores(llama, edit, shift), expected, rtol=1e-4)


def test_oracle_ranks_by_all_layer_kv_deviation_from_clean(llama):
    edit = random_edit(13, 8, 5, 70)
    p = edit.prefix_len
    prepared = prepare(llama, edit)
    clean = reprefill(llama, edit)
    dev = sum(
        (layer_kv(clean, l)[i] - layer_kv(prepared.shift_cache, l)[i])[0, :, p:].square().sum(dim=(0, 2))
        for l in range(3) for i in range(2)
    ).sqrt().numpy()
    np.testing.assert_allclose(prior.clean_deviation(llama, edit, prepared.shift_cache), dev, rtol=1e-8)
    sel = allocate("Clean-state oracle", AllocationRequest(llama, edit, 20, shift_cache=prepared.shift_cache))
    assert sel.support.positions.tolist() == top_b(dev, 14).tolist()
    assert sel.extra_forward_tokens == 70


# ---------------------------------------------------------------------------------------------------------------------
# SpecCache-Adapted


def test_threshold_and_completion_spans():
    assert prior.threshold_spans(np.array([0, 1, 1, 0, 1] + [1] * 20, dtype=bool), max_len=16) == [
        (1, 3), (4, 15), (15, 25),  # a 21-token run splits 11 + 10
    ]
    assert prior.complete_spans([(0, 4), (5, 8), (20, 22)], max_len=16, coverage=0.7) == [(0, 8), (20, 22)]
    assert prior.complete_spans([(0, 2), (6, 8)], max_len=16, coverage=0.7) == [(0, 2), (6, 8)]  # 4/8 < 0.7
    assert prior.complete_spans([(0, 10), (11, 20)], max_len=16, coverage=0.7) == [(0, 10), (11, 20)]  # extent 20


def test_smooth_spans_normalizes_and_smooths():
    spans, z = prior.smooth_spans(np.array([2.0, 2, 4, 4, 4, 2, 2, 2, 4, 2]))
    assert z.tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 1, 0]
    assert spans == [(2, 5)]  # the isolated peak at 8 smooths to 1/3 < 0.4


def test_speccache_positions_truncates_then_fills():
    z = np.array([0.0, 0.9, 0.9, 0.1, 0.5, 0.6, 0.7, 0.2])
    target = np.arange(8)
    assert prior.speccache_positions([(4, 7), (1, 3)], z, target, 8, 4).tolist() == [1, 2, 4, 5]
    assert prior.speccache_positions([(1, 3)], z, target, 8, 4).tolist() == [1, 2, 5, 6]


def test_hidden_norm_scores_average_the_last_third_of_layers():
    lm = make_tiny_model("llama", layers=6)
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(0))
    store = {}
    with signals.capture_residual_norms(lm, [3, 4], store):
        signals.forward_layers(lm, ids, __import__("transformers").DynamicCache())
    hidden = lm.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    for layer in (3, 4):  # hidden_states[l + 1] is layer l's output (the last entry is after the final norm)
        torch.testing.assert_close(store[layer], hidden[layer + 1][0].float().norm(dim=-1), rtol=1e-6, atol=1e-6)
    full = {}
    with signals.capture_residual_norms(lm, [4, 5], full):
        scores = prior.hidden_norm_scores(lm, ids)
    np.testing.assert_allclose(scores, ((full[4].double() + full[5].double()) / 2).numpy(), rtol=1e-12)


def test_speccache_maps_an_auxiliary_tokenization_through_text(text_lm):
    aux = dataclasses.replace(make_tiny_model("qwen3", seed=5), tokenizer=text_lm.tokenizer)
    edit = text_edit(text_lm.tokenizer)
    ids, target, first = prior._aux_suffix_map(edit, aux, text_lm)
    assert first == edit.prefix_len and ids.tolist() == edit.edited_ids.tolist()
    assert target[first:].tolist() == list(range(edit.suffix_len))
    sel = allocate("SpecCache-Adapted", AllocationRequest(text_lm, edit, 20, options={"aux_model": aux}))
    assert sel.diagnostics["aux_model"] == "tiny-qwen3" and sel.extra_forward_tokens == edit.edited_len


@pytest.mark.parametrize(
    "name", ["ProphetKV-Adapted", "CacheTune-Adapted", "Clean-state oracle", "Cache-Craft-Adapted"]
)
def test_shift_cache_readers_refuse_a_missing_or_foreign_cache(llama, name):
    edit = random_edit(14, 5, 3, 40)
    with pytest.raises(ValueError, match="shift_cache"):
        allocate(name, AllocationRequest(llama, edit, 10))
    other = prepare(llama, random_edit(14, 5, 3, 41)).shift_cache
    with pytest.raises(ValueError, match="shift_cache"):
        allocate(name, AllocationRequest(llama, edit, 10, shift_cache=other))
