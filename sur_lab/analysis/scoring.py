"""Answer extraction and per-dataset exact match for natural multi-hop QA (appendix 7.5), plus fidelity measures.

Appendix 7.5: "Natural-QA results use answer-only EM with dataset-specific normalization. HotpotQA uses normalized
string EM. 2WikiMultiHopQA additionally maximizes over answer aliases [...]; MuSiQue uses the answer and its
supplied aliases. IIRC uses the DROP evaluator's numeric-aware normalization and span matching. All scorers use the
same extracted answers."

So every scorer here takes an answer already passed through :func:`extract_answer` once; none extracts again.

Sources followed (re-implemented here, not copied):

- SQuAD v1.1 ``evaluate-v1.1.py`` ``normalize_answer`` (also used verbatim by HotpotQA's ``hotpot_evaluate_v1.py``,
  MuSiQue's ``metrics/answer.py`` and 2WikiMultiHopQA's ``evaluate.py``): lowercase, drop ASCII punctuation, drop the
  articles a/an/the, collapse whitespace.
- DROP's official evaluator, ``allennlp_rc/eval/drop_eval.py`` in allenai/allennlp-reading-comprehension (Dua et al.,
  2019; the same logic ships as openai/simple-evals ``drop_eval.py``): ``_normalize_answer`` tokenizes on spaces and
  hyphens, lowercases, strips punctuation from non-numbers, writes numbers as ``str(float(x))``, drops articles;
  ``_answer_to_bags`` turns an answer (a string or a list of spans) into its list of normalized spans and their token
  bags; ``get_metrics`` scores exact match as equality of the span *sets* with equal span *counts*, and F1 by an
  optimal one-to-one alignment of token bags (``_align_bags``) that only pairs bags whose numbers agree.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.optimize import linear_sum_assignment

# Chat-template end-of-turn / end-of-text markers (Qwen, Llama 3, GLM, Gemma, SentencePiece). Text after the first one
# was generated past the end of the turn and is discarded.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<|return|>",
    "<|user|>",
    "<|observation|>",
    "<end_of_turn>",
    "</s>",
)

# IIRC predictions accepted as "no answer" for answer_type "none", compared after normalize_answer. IIRC's own gold for
# these questions is the string "none"; the rest are the common phrasings an instruction-tuned model uses instead.
NONE_PREDICTIONS = (
    "none",
    "no answer",
    "unanswerable",
    "not answerable",
    "unknown",
    "cannot be answered",
    "cannot be determined",
    "not enough information",
    "insufficient information",
)

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_ANSWER_MARKER = re.compile(r"\banswer\s*:", re.IGNORECASE)
_TRAILING = " \t.,;:!"
_WRAPPERS = ("**", "__", '"', "'", "`", "“", "”")
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = frozenset(string.punctuation)
# Separators between spans of a multi-span prediction: ";", "&", or a comma followed by whitespace (so "1,000" stays
# whole), each optionally followed by "and" (Oxford comma). _SPAN_SEP_AND also splits on a bare " and ".
_SPAN_SEP = re.compile(r"\s*(?:;|,(?=\s)|\s&\s)\s*(?:and\s+)?", re.IGNORECASE)
_SPAN_SEP_AND = re.compile(r"\s*(?:;|,(?=\s)|\s&\s)\s*(?:and\s+)?|\s+and\s+", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------------------------------
# Extraction and SQuAD-style normalization


def extract_answer(text: str) -> str:
    """Extract the short answer from a model's generated text; shared by every scorer (appendix 7.5).

    Steps, in order: remove ``<think>...</think>`` blocks (and everything before a stray ``</think>``, or from an
    unclosed ``<think>`` onwards: that answer never finished thinking); cut at the first end-of-turn token
    (:data:`END_OF_TURN_TOKENS`); keep the text after the first ``Answer:`` (case-insensitive) when present, so that a
    model that runs on into a new few-shot question is scored on its first answer; keep the first non-empty line;
    strip surrounding whitespace, markdown emphasis and quotes, and trailing ``. , ; : !``.

    Args:
        text: decoded generation (str); ``None`` is treated as empty.

    Returns:
        The answer string ("" when nothing is left).
    """
    if not text:
        return ""
    t = _THINK_BLOCK.sub(" ", text)
    lower = t.lower()
    close = lower.rfind("</think>")
    if close >= 0:
        t = t[close + len("</think>") :]
    open_ = t.lower().find("<think>")
    if open_ >= 0:
        t = t[:open_]
    for tok in END_OF_TURN_TOKENS:
        cut = t.find(tok)
        if cut >= 0:
            t = t[:cut]
    marker = _ANSWER_MARKER.search(t)
    if marker is not None:
        t = t[marker.end() :]
    line = next((ln for ln in t.splitlines() if ln.strip()), "")
    return _strip_answer(line)


def _strip_answer(s: str) -> str:
    prev = None
    while prev != s:
        prev = s
        s = s.strip().rstrip(_TRAILING)
        for w in _WRAPPERS:
            if len(s) >= 2 * len(w) and s.startswith(w) and s.endswith(w):
                s = s[len(w) : -len(w)]
    return s


def normalize_answer(s: str) -> str:
    """SQuAD v1.1 answer normalization: lowercase, remove punctuation, remove articles a/an/the, collapse whitespace.

    Used by HotpotQA, 2WikiMultiHopQA and MuSiQue's official evaluators (appendix 7.5).

    Args:
        s: answer text.

    Returns:
        The normalized string (possibly "").
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match(prediction: str, answers: str | Sequence[str]) -> bool:
    """Normalized exact match, maximized over the gold answer and its aliases (appendix 7.5).

    Args:
        prediction: extracted answer (output of :func:`extract_answer`).
        answers: one gold answer or a sequence of gold answer and aliases.

    Returns:
        ``True`` iff ``normalize_answer(prediction)`` is non-empty and equals the normalization of some answer. An
        empty prediction is never correct.
    """
    pred = normalize_answer(prediction or "")
    if not pred:
        return False
    golds = [answers] if isinstance(answers, str) else list(answers)
    return any(pred == normalize_answer(g) for g in golds)


def agreement(a: str, b: str) -> bool:
    """Whether two extracted answers agree after :func:`normalize_answer` (continuation agreement, appendix 10.3).

    Args:
        a, b: extracted answers, e.g. a repaired method's and the clean reference's.

    Returns:
        ``True`` iff the normalized strings are equal (two empty answers agree).
    """
    return normalize_answer(a or "") == normalize_answer(b or "")


# ---------------------------------------------------------------------------------------------------------------------
# DROP evaluator (IIRC)


def _drop_is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def drop_normalize(text: str) -> str:
    """DROP's ``_normalize_answer``: per space/hyphen token, lowercase, strip punctuation unless the token parses as
    a number, canonicalize numbers as ``str(float(token))``, drop articles; rejoin non-empty tokens.

    So ``"1,000"`` and ``"1000"`` both become ``"1000.0"``, and ``"3.0"`` and ``"3"`` both become ``"3.0"``.

    Args:
        text: one answer span.

    Returns:
        The normalized span.
    """
    parts = []
    for token in re.split(" |-", text):
        token = token.lower()
        if not _drop_is_number(token):
            token = "".join(ch for ch in token if ch not in _PUNCT)
        if _drop_is_number(token):
            token = str(float(token))
        token = " ".join(_ARTICLES.sub(" ", token).split())
        if token.strip():
            parts.append(token)
    return " ".join(parts).strip()


def _drop_bags(answer: str | Sequence[str]) -> tuple[list[str], list[set[str]]]:
    """DROP's ``_answer_to_bags``: normalized spans (a list, duplicates kept) and one token set per span."""
    raw = [answer] if isinstance(answer, str) else list(answer)
    spans = [drop_normalize(s) for s in raw]
    return spans, [set(s.split()) for s in spans]


def drop_exact_match(prediction: str | Sequence[str], gold: str | Sequence[str]) -> bool:
    """DROP exact match (``get_metrics``): same set of normalized spans and the same number of spans.

    Args:
        prediction: one span or a sequence of predicted spans.
        gold: one span or the gold bag of spans (all required).

    Returns:
        ``True`` iff the span sets are equal and the span counts match.
    """
    p, _ = _drop_bags(prediction)
    g, _ = _drop_bags(gold)
    return set(p) == set(g) and len(p) == len(g)


def _token_f1(pred: set[str], gold: set[str]) -> float:
    inter = len(pred & gold)
    precision = inter / len(pred) if pred else 1.0
    recall = inter / len(gold) if gold else 1.0
    return 0.0 if precision == 0.0 and recall == 0.0 else 2 * precision * recall / (precision + recall)


def _numbers_agree(gold: set[str], pred: set[str]) -> bool:
    gold_numbers = {w for w in gold if _drop_is_number(w)}
    pred_numbers = {w for w in pred if _drop_is_number(w)}
    return not gold_numbers or bool(gold_numbers & pred_numbers)


def drop_f1(prediction: str | Sequence[str], gold: str | Sequence[str]) -> float:
    """DROP F1: optimal one-to-one alignment of predicted and gold token bags (``_align_bags``), mean over gold bags.

    A pair scores 0 unless it shares a number whenever the gold bag holds one. Unlike the reference script the value
    is not rounded to two decimals.

    Args:
        prediction: one span or a sequence of predicted spans.
        gold: one span or the gold bag of spans.

    Returns:
        F1 in [0, 1].
    """
    _, pred_bags = _drop_bags(prediction)
    _, gold_bags = _drop_bags(gold)
    scores = np.zeros((len(gold_bags), len(pred_bags)))
    for i, g in enumerate(gold_bags):
        for j, p in enumerate(pred_bags):
            if _numbers_agree(g, p):
                scores[i, j] = _token_f1(p, g)
    rows, cols = linear_sum_assignment(-scores)
    best = np.zeros(max(len(gold_bags), len(pred_bags)))
    for r, c in zip(rows, cols):
        best[r] = max(best[r], scores[r, c])
    return float(np.mean(best))


def split_spans(prediction: str, *, split_and: bool = False) -> list[str]:
    """Split a one-line multi-span prediction into spans for DROP bag matching.

    Separators: ``;``, `` & ``, or a comma followed by whitespace (``"1,000"`` is not split), each optionally followed
    by "and"; with ``split_and`` also a bare " and ".

    Args:
        prediction: extracted answer.
        split_and: also split on " and ".

    Returns:
        Non-empty stripped spans (``[prediction]`` when there is no separator).
    """
    sep = _SPAN_SEP_AND if split_and else _SPAN_SEP
    return [s.strip() for s in sep.split(prediction) if s.strip()]


def iirc_exact_match(prediction: str, answers: Sequence[str], answer_type: str) -> bool:
    """IIRC exact match with DROP's normalization and span matching (appendix 7.5).

    - ``"none"``: correct iff the normalized prediction is one of :data:`NONE_PREDICTIONS` (normalized).
    - ``"binary"``: DROP exact match against "yes"/"no"; the prediction must be the bare word ("Yes." counts,
      "Yes, both" does not).
    - ``"number"`` and single-span ``"spans"``: DROP exact match of the whole prediction against the gold span.
    - multi-span ``"spans"`` (several entries in ``answers``, all required): DROP's ``get_metrics`` compares span
      sets, and a model answers in one line, so the prediction is split into spans (:func:`split_spans`, first without
      and then with " and " as a separator) and is correct if either split matches the gold bag.

    Args:
        prediction: extracted answer.
        answers: the example's ``answers`` (gold bag for multi-span; ``("none",)`` for unanswerable).
        answer_type: one of ``"spans"``, ``"number"``, ``"binary"``, ``"none"``.

    Returns:
        Whether the prediction is correct; an empty prediction never is.

    Raises:
        ValueError: naming ``answer_type`` when it is not one of IIRC's types.
    """
    if answer_type not in {"spans", "number", "binary", "none"}:  # checked first: an empty prediction must not hide it
        raise ValueError(f"answer_type={answer_type!r} is not one of 'spans', 'number', 'binary', 'none'")
    pred = (prediction or "").strip()
    if not drop_normalize(pred):
        return False
    if answer_type == "none":
        return drop_normalize(pred) in {drop_normalize(s) for s in NONE_PREDICTIONS}
    gold = list(answers)
    if answer_type == "spans" and len(gold) > 1:
        candidates = [split_spans(pred), split_spans(pred, split_and=True)]
        return any(drop_exact_match(c, gold) for c in candidates)
    return any(drop_exact_match(pred, g) for g in gold)


def score_example(prediction: str, example: Any) -> bool:
    """Answer-only exact match with the example's dataset-specific rule (appendix 7.5).

    - ``hotpotqa``: normalized string EM (:func:`exact_match`).
    - ``2wikimultihopqa``: normalized EM maximized over ``example.answers`` (gold and any aliases the file supplies;
      the shipped IRCoT files supply none, and 2Wiki's separate alias/demonym table is not shipped).
    - ``musique``: normalized EM over the answer and its ``answer_aliases``.
    - ``iirc``: :func:`iirc_exact_match` with ``example.answer_type``.

    Args:
        prediction: extracted answer (output of :func:`extract_answer`), the same string for every scorer.
        example: the gold example (a :class:`sur_lab.data.qa.QAExample` or any object with its fields).

    Returns:
        Whether the prediction is correct; an empty prediction never is.

    Raises:
        ValueError: naming ``example.dataset`` when it has no scorer.
    """
    if example.dataset in {"hotpotqa", "2wikimultihopqa", "musique"}:
        return exact_match(prediction, example.answers)
    if example.dataset == "iirc":
        return iirc_exact_match(prediction, example.answers, example.answer_type)
    raise ValueError(f"example.dataset={example.dataset!r} has no scorer")


# ---------------------------------------------------------------------------------------------------------------------
# First-token distribution fidelity


def _as_float64(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # torch.Tensor; torch is not imported here so that scoring stays light
        x = x.detach().cpu().double().numpy()
    arr = np.asarray(x, dtype=np.float64)
    while arr.ndim > 1 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must have shape (vocab,) (leading size-1 dims allowed), got {np.shape(x)}")
    return arr


def _softmax64(logits: np.ndarray, name: str) -> np.ndarray:
    top = logits.max()
    if not np.isfinite(top):
        raise ValueError(f"{name} has no finite maximum (all -inf, +inf or NaN)")
    e = np.exp(logits - top)
    return e / e.sum()


def first_token_tv(p_logits: Any, q_logits: Any) -> float:
    """Total variation between the next-token distributions of two first-token logit vectors (appendix 10.3).

    ``TV(p, q) = 0.5 * sum_v |softmax(p)_v - softmax(q)_v|``, computed in float64 whatever the input dtype (BF16
    logits are upcast before the softmax, so the value measures the models, not the softmax's rounding).

    Args:
        p_logits, q_logits: logits of shape (vocab,) (or with leading size-1 dims, e.g. (1, vocab)); numpy arrays,
            torch tensors on any device and dtype, or sequences.

    Returns:
        TV in [0, 1].

    Raises:
        ValueError: naming ``p_logits``/``q_logits`` when a shape is not (vocab,), the vocab sizes differ, or a vector
            has no finite maximum.
    """
    p = _as_float64(p_logits, "p_logits")
    q = _as_float64(q_logits, "q_logits")
    if p.shape != q.shape:
        raise ValueError(f"p_logits and q_logits vocab sizes differ: {p.shape[0]} vs {q.shape[0]}")
    return float(0.5 * np.abs(_softmax64(p, "p_logits") - _softmax64(q, "q_logits")).sum())
