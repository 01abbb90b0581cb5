"""Answer extraction and exact-match scorers (appendix 7.5) on hand cases, DROP's rules, and first-token TV."""

from __future__ import annotations

import string

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sur_lab.data.qa import Passage, QAExample
from sur_lab.analysis.scoring import (
    NONE_PREDICTIONS,
    agreement,
    drop_exact_match,
    drop_f1,
    drop_normalize,
    exact_match,
    extract_answer,
    first_token_tv,
    iirc_exact_match,
    normalize_answer,
    score_example,
    split_spans,
)

_SUPPORT = (Passage("t", "text", True),)


def _ex(dataset: str, answers: tuple[str, ...], answer_type: str = "span") -> QAExample:
    return QAExample("q0", "question?", answers, answer_type, _SUPPORT, (), dataset)


# --------------------------------------------------------------------------------------------------------------------
# extract_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Paris", "Paris"),
        ("Paris.", "Paris"),
        ("  Paris  \n\nMore text", "Paris"),
        ("Answer: Paris", "Paris"),
        ("answer:Paris.<|im_end|>", "Paris"),
        ("Reasoning first.\nAnswer: Paris\nQuestion: next? Answer: Rome", "Paris"),
        ("<think>The answer: Rome? no</think>\nAnswer: Paris", "Paris"),
        ("<think>\n\n</think>\n\nParis<|im_end|>", "Paris"),
        ("reasoning</think>Paris", "Paris"),  # template opened <think> in the prompt
        ("<think>still thinking, never finished", ""),
        ("Paris<|eot_id|>junk after the turn", "Paris"),
        ("**Paris**", "Paris"),
        ('"Paris"', "Paris"),
        ("Answer:\n  1,000.", "1,000"),
        ("", ""),
        ("<|im_end|>", ""),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_keeps_internal_punctuation():
    assert extract_answer("Answer: Begrijpt U Nu Waarom Ik Huil?") == "Begrijpt U Nu Waarom Ik Huil?"
    assert extract_answer("U.S.") == "U.S"


# --------------------------------------------------------------------------------------------------------------------
# SQuAD-style normalization and EM


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("the Eiffel Tower", "Eiffel Tower"),
        ("An apple", "apple"),
        ("EIFFEL   tower!", "eiffel tower"),
        ("1,000", "1000"),
        ("Gesellschaft mit beschränkter Haftung", "gesellschaft mit beschränkter haftung"),
        ("Yes", "yes"),
    ],
)
def test_exact_match_normalizes(pred, gold):
    assert exact_match(pred, gold)


def test_exact_match_rejects():
    assert not exact_match("Eiffel", "Eiffel Tower")
    assert not exact_match("", "Eiffel Tower")
    assert not exact_match("the", "")  # both normalize to "": an empty prediction is never correct
    assert not exact_match("3.0", "3")  # SQuAD normalization is not numeric-aware


def test_exact_match_aliases():
    answers = ("for Best Performance by a Leading Actress in a Play in Ondine", "leading role", "lead")
    assert exact_match("Leading role", answers)
    assert exact_match("Lead.", answers)
    assert not exact_match("star", answers)


def test_normalize_answer_rules():
    assert normalize_answer("  The  Quick, brown fox!  ") == "quick brown fox"
    assert normalize_answer("theatre an apple") == "theatre apple"  # articles only as whole words


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=string.ascii_letters + string.digits + string.punctuation + " ", max_size=40))
def test_normalize_answer_idempotent_and_case_punct_invariant(s):
    n = normalize_answer(s)
    assert normalize_answer(n) == n
    assert normalize_answer(s.upper()) == n
    assert normalize_answer("The " + s + "!") == normalize_answer(s) or normalize_answer(s) == ""


# --------------------------------------------------------------------------------------------------------------------
# DROP rules (IIRC)


def test_drop_normalize_numbers():
    assert drop_normalize("1,000") == drop_normalize("1000") == "1000.0"
    assert drop_normalize("3.0") == drop_normalize("3") == "3.0"
    assert drop_normalize("26,688 people") == "26688.0 people"
    assert drop_normalize("well-known") == "well known"


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=10**9))
def test_drop_thousands_separator(n):
    assert drop_exact_match(f"{n:,}", str(n))
    assert drop_exact_match(f"{n}.0", str(n))


def test_drop_exact_match_spans_and_dates():
    assert drop_exact_match("8 February 1992", "8 February 1992")
    assert drop_exact_match(["February 1992", "8"], ["8", "February 1992"])  # a bag: order does not matter
    assert not drop_exact_match("8 February 1992", ["8", "February 1992"])  # one span vs two
    assert not drop_exact_match(["8"], ["8", "February 1992"])
    # DROP compares span counts: a duplicated gold span needs a duplicated prediction.
    assert not drop_exact_match(["Detroit Red Wings"], ["Detroit Red Wings", "Detroit Red Wings"])
    assert drop_exact_match(["Detroit Red Wings"] * 2, ["Detroit Red Wings", "Detroit Red Wings"])


def test_drop_f1_alignment():
    assert drop_f1(["a b", "c d"], ["c d", "a b"]) == 1.0
    assert drop_f1("x y", "x z") == pytest.approx(0.5)
    # numbers must agree when the gold holds one, whatever the token overlap
    assert drop_f1("1992 games", "1993 games") == 0.0
    # two gold bags, one predicted: the unmatched gold bag scores 0
    assert drop_f1("Greece", ["Greece", "Bulgaria"]) == pytest.approx(0.5)


def test_split_spans():
    assert split_spans("Greece, Bulgaria") == ["Greece", "Bulgaria"]
    assert split_spans("A; B & C") == ["A", "B", "C"]
    assert split_spans("1,000") == ["1,000"]
    assert split_spans("A, B, and C") == ["A", "B", "C"]
    assert split_spans("A and B") == ["A and B"]
    assert split_spans("A and B", split_and=True) == ["A", "B"]


def test_iirc_multi_span():
    gold = ("Greece", "Bulgaria")
    assert iirc_exact_match("Bulgaria, Greece", gold, "spans")
    assert iirc_exact_match("Greece and Bulgaria", gold, "spans")
    assert not iirc_exact_match("Greece", gold, "spans")
    band = ("Tony Banks", "Mike Rutherford", "Anthony Phillips and Steve Hackett")
    assert iirc_exact_match("Tony Banks, Mike Rutherford, Anthony Phillips and Steve Hackett", band, "spans")
    # a single-span gold is not split
    assert iirc_exact_match("Anthony Phillips and Steve Hackett", ("Anthony Phillips and Steve Hackett",), "spans")


def test_iirc_numbers_binary_none():
    assert iirc_exact_match("1,000", ("1000",), "number")
    assert iirc_exact_match("3.0", ("3",), "number")
    assert not iirc_exact_match("4", ("3",), "number")
    assert iirc_exact_match("26688", ("26,688",), "spans")
    assert iirc_exact_match("Yes", ("yes",), "binary")
    assert not iirc_exact_match("No", ("yes",), "binary")
    assert not iirc_exact_match("Yes, both did", ("yes",), "binary")
    for phrase in NONE_PREDICTIONS:
        assert iirc_exact_match(phrase.capitalize() + ".", ("none",), "none"), phrase
    assert not iirc_exact_match("Paris", ("none",), "none")
    assert not iirc_exact_match("none", ("Paris",), "spans")
    with pytest.raises(ValueError, match="answer_type"):
        iirc_exact_match("x", ("x",), "value")


@pytest.mark.parametrize("dataset", ["hotpotqa", "2wikimultihopqa", "musique"])
def test_score_example_string_em(dataset):
    ex = _ex(dataset, ("Henry Wellcome", "Wellcome"))
    assert score_example("henry wellcome", ex)
    assert score_example("Wellcome.", ex)
    assert not score_example("Henry", ex)
    assert not score_example("", ex)


def test_score_example_iirc_and_empty():
    assert score_example("3", _ex("iirc", ("3.0",), "number"))
    assert score_example("unanswerable", _ex("iirc", ("none",), "none"))
    assert not score_example("", _ex("iirc", ("none",), "none"))
    assert not score_example("", _ex("iirc", ("yes",), "binary"))
    with pytest.raises(ValueError, match="example.dataset"):
        score_example("x", _ex("squad", ("x",)))


def test_agreement():
    assert agreement("The Eiffel Tower.", "eiffel tower")
    assert not agreement("Paris", "Rome")
    assert agreement("", "")


# --------------------------------------------------------------------------------------------------------------------
# first_token_tv


def _tv_reference(p, q):
    p = np.exp(p - p.max()) / np.exp(p - p.max()).sum()
    q = np.exp(q - q.max()) / np.exp(q - q.max()).sum()
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


def test_first_token_tv_values():
    rng = np.random.default_rng(0)
    p, q = rng.normal(size=113), rng.normal(size=113)
    assert first_token_tv(p, p) == 0.0
    assert first_token_tv(p, q) == pytest.approx(_tv_reference(p, q), rel=1e-12)
    assert first_token_tv(p, q) == pytest.approx(first_token_tv(q, p), rel=1e-12)
    assert first_token_tv(p, p + 7.5) == pytest.approx(0.0, abs=1e-15)  # softmax is shift invariant
    peaked_a, peaked_b = np.full(4, -1e4), np.full(4, -1e4)
    peaked_a[0], peaked_b[1] = 0.0, 0.0
    assert first_token_tv(peaked_a, peaked_b) == pytest.approx(1.0)
    assert first_token_tv(p[None, :], q) == pytest.approx(_tv_reference(p, q), rel=1e-12)
    masked = p.copy()
    masked[:3] = -np.inf
    assert 0.0 <= first_token_tv(masked, q) <= 1.0


def test_first_token_tv_torch_bf16():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    p, q = torch.tensor(rng.normal(size=239)).bfloat16(), torch.tensor(rng.normal(size=239)).bfloat16()
    # bf16 inputs are upcast exactly, so the value equals the float64 computation on the rounded logits
    expected = _tv_reference(p.double().numpy(), q.double().numpy())
    assert first_token_tv(p, q) == pytest.approx(expected, rel=1e-12)


def test_first_token_tv_rejects_bad_shapes():
    with pytest.raises(ValueError, match="p_logits and q_logits"):
        first_token_tv(np.zeros(5), np.zeros(6))
    with pytest.raises(ValueError, match="p_logits"):
        first_token_tv(np.zeros((2, 5)), np.zeros((2, 5)))
    with pytest.raises(ValueError, match="q_logits"):
        first_token_tv(np.zeros(3), np.full(3, -np.inf))
