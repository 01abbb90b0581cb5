"""Fidelity endpoints (appendix 10.3, 11): first-token JSD, argmax agreement, exact-logit agreement, sequence
agreement, the gold-answer NLL and the canonical answer's tokens, against hand-computed values and references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sur_lab.analysis.endpoints import (
    JSD_MAX,
    argmax_agree,
    canonical_answer_ids,
    first_token_jsd,
    gold_nll,
    logits_digest,
    logits_identical,
    sequence_agree,
)
from sur_lab.analysis.scoring import first_token_tv

LN2 = math.log(2.0)

logit_vectors = arrays(np.float64, st.integers(2, 12), elements=st.floats(-30, 30))


# --------------------------------------------------------------------------------------------------------------------
# JSD


def test_jsd_hand_values():
    inf = -np.inf
    assert first_token_jsd([0.0, inf], [inf, 0.0]) == pytest.approx(LN2, abs=1e-15)  # disjoint supports: ln 2
    # p = (1/2, 1/2), q = (1, 0): m = (3/4, 1/4); KL(p||m) = 1/2 ln(4/3), KL(q||m) = ln(4/3) -> JSD = 3/4 ln(4/3)
    assert first_token_jsd([0.0, 0.0], [0.0, inf]) == pytest.approx(0.75 * math.log(4 / 3), rel=1e-14)
    # p = (3/4, 1/4) from logits (ln 3, 0), q = (1/4, 3/4): m = (1/2, 1/2), JSD = KL(p||m) = 3/4 ln(3/2) + 1/4 ln(1/2)
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert first_token_jsd([math.log(3), 0.0], [0.0, math.log(3)]) == pytest.approx(expected, rel=1e-13)
    assert JSD_MAX == LN2


def test_identical_logits_give_zero_jsd_and_exact_agreement():
    z = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert first_token_jsd(z, z.clone()) == 0.0
    assert logits_identical(z, z.clone())
    assert argmax_agree(z, z.clone())
    assert logits_digest(z) == logits_digest(z.clone().numpy())
    whole = torch.round(z * 4)  # integer-valued logits: the shift by 3 is exact in float32
    assert first_token_jsd(whole, whole + 3.0) == 0.0  # softmax is shift invariant
    assert not logits_identical(whole, whole + 3.0)  # but the logits are different bytes


@settings(max_examples=80, deadline=None)
@given(p=logit_vectors, data=st.data())
def test_jsd_symmetric_bounded_and_matches_scipy(p, data):
    from scipy.special import rel_entr

    q = data.draw(arrays(np.float64, p.shape, elements=st.floats(-30, 30)))
    j = first_token_jsd(p, q)
    assert j == pytest.approx(first_token_jsd(q, p), abs=1e-15)
    assert 0.0 <= j <= LN2
    pp = np.exp(p - p.max()) / np.exp(p - p.max()).sum()
    qq = np.exp(q - q.max()) / np.exp(q - q.max()).sum()
    m = (pp + qq) / 2
    # scipy's divergence, base e (jensenshannon returns its square root, which is NaN when rounding makes it -1e-17).
    assert j == pytest.approx((rel_entr(pp, m).sum() + rel_entr(qq, m).sum()) / 2, abs=1e-12)
    # Lin (1991): JSD <= TV * ln 2 (both vanish together).
    assert j <= first_token_tv(p, q) * LN2 + 1e-12


def test_jsd_accepts_torch_bf16_and_refuses_bad_shapes():
    p = torch.tensor([1.0, 2.0, 0.5], dtype=torch.bfloat16)
    q = torch.tensor([0.5, 2.0, 1.0], dtype=torch.bfloat16)
    assert first_token_jsd(p, q) == pytest.approx(first_token_jsd(p.double().numpy(), q.double().numpy()), abs=0)
    with pytest.raises(ValueError, match="vocab sizes"):
        first_token_jsd(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="q_logits"):
        first_token_jsd(np.zeros(3), np.full(3, -np.inf))


# --------------------------------------------------------------------------------------------------------------------
# argmax, exact logits, sequences


def test_argmax_agree():
    assert argmax_agree([0.1, 3.0, 2.0], [5.0, 9.0, -1.0])
    assert not argmax_agree([0.1, 3.0, 2.0], [5.0, 1.0, -1.0])
    assert argmax_agree([1.0, 1.0], [1.0, 0.0])  # tie resolves to the lowest id
    assert not argmax_agree([1.0, 1.0], [0.0, 1.0])
    with pytest.raises(ValueError, match="vocab sizes"):
        argmax_agree([1.0], [1.0, 2.0])


def test_logits_identical_is_byte_equality():
    z = np.linspace(-3, 3, 11, dtype=np.float32)
    one_ulp = z.copy()
    one_ulp[4] = np.nextafter(one_ulp[4], np.float32(10))
    assert logits_identical(z, z.copy())
    assert not logits_identical(z, one_ulp)  # closeness is not identity
    assert logits_digest(z) != logits_digest(one_ulp)
    assert not logits_identical(np.array([0.0], np.float32), np.array([-0.0], np.float32))
    assert not logits_identical(z, z[:-1])
    assert logits_identical(torch.from_numpy(z)[None, :], z)  # (1, V) batch of one
    bf = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    assert logits_identical(bf, bf.float())  # bfloat16 widens to float32 exactly
    with pytest.raises(ValueError, match="float64"):
        logits_identical(z.astype(np.float64), z)
    with pytest.raises(ValueError, match="q_logits"):
        logits_identical(z, torch.from_numpy(z).double())
    with pytest.raises(ValueError, match="shape"):
        logits_identical(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32))


def test_sequence_agree():
    assert sequence_agree([1, 2, 3], (1, 2, 3))
    assert sequence_agree(torch.tensor([4, 5]), np.array([4, 5]))
    assert sequence_agree([], ())
    assert not sequence_agree([1, 2, 3], [1, 2])
    assert not sequence_agree([1, 2, 3], [1, 2, 4])
    with pytest.raises(ValueError, match="a_ids"):
        sequence_agree("abc", [1])
    with pytest.raises(ValueError, match="b_ids"):
        sequence_agree([1], [1.5])
    with pytest.raises(ValueError, match="b_ids"):
        sequence_agree([1], [-1])


# --------------------------------------------------------------------------------------------------------------------
# gold NLL


def test_gold_nll_hand_values():
    # Uniform rows over 2 tokens: every answer token costs ln 2.
    assert gold_nll(np.zeros((2, 2)), [0, 1]) == pytest.approx(LN2, rel=1e-15)
    # Row 0 gives the gold token 3/4 (logits ln 3, 0), row 1 gives it 1/4: mean of -ln(3/4) and -ln(1/4).
    z = np.array([[math.log(3), 0.0], [math.log(3), 0.0]])
    assert gold_nll(z, [0, 1]) == pytest.approx(0.5 * (-math.log(0.75) - math.log(0.25)), rel=1e-14)
    # One token, certain: 0 nats.
    assert gold_nll(np.array([[0.0, -np.inf]]), [0]) == 0.0


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(2, 9), st.integers(0, 1000))
def test_gold_nll_matches_torch_cross_entropy(t, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(t, vocab, generator=g, dtype=torch.float64) * 5
    y = torch.randint(0, vocab, (t,), generator=g)
    ref = torch.nn.functional.cross_entropy(z, y, reduction="mean").item()
    assert gold_nll(z, y.tolist()) == pytest.approx(ref, rel=1e-12, abs=1e-15)
    assert gold_nll(z.float(), y) == pytest.approx(gold_nll(z.float().double(), y), abs=0)


def test_gold_nll_validation():
    with pytest.raises(ValueError, match="gold_ids"):
        gold_nll(np.zeros((0, 3)), [])
    with pytest.raises(ValueError, match="logits"):
        gold_nll(np.zeros((2, 3)), [0])
    with pytest.raises(ValueError, match="gold_ids"):
        gold_nll(np.zeros((1, 3)), [3])
    with pytest.raises(ValueError, match="gold_ids"):
        gold_nll(np.zeros((1, 3)), [0.5])
    with pytest.raises(ValueError, match="logits"):
        gold_nll(np.full((1, 3), np.nan), [0])


# --------------------------------------------------------------------------------------------------------------------
# canonical answer tokens



@pytest.mark.parametrize("answer", ["Paris", "Vytautas the Great", "1,000", "yes", "  The Who  "])
def test_canonical_answer_ids_follow_the_query(tokenizer, answer):
    from sur_lab.edits import render_chat

    _, query_text, _, _ = render_chat(tokenizer, "Title: A\nText.", "Where?")
    ids = canonical_answer_ids(tokenizer, answer, query_text)
    assert query_text.endswith("\n")  # the chat generation prompt: no leading space
    assert ids == tokenizer(answer.strip(), add_special_tokens=False)["input_ids"]
    # The answer tokenized after the whole query text ends in exactly these ids: the boundary is a token boundary.
    whole = tokenizer(query_text + answer.strip(), add_special_tokens=False)["input_ids"]
    assert whole[-len(ids):] == ids
    assert tokenizer.decode(ids) == answer.strip()
    completion = canonical_answer_ids(tokenizer, answer, "Question: Where?\nAnswer:")
    assert completion == tokenizer(" " + answer.strip(), add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="answer"):
        canonical_answer_ids(tokenizer, "   ", query_text)
