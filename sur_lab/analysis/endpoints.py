"""Per-record fidelity endpoints beyond exact match (Eq. 14; appendix 10.2-10.3 and 11): pure functions on logits
and token-id sequences.

Every sweep record compares a method's answer with the clean reference (Re-prefill) on these endpoints (record field,
definition, function):

- ``tv_reprefill``: ``TV(p, q) = 1/2 sum_v |p_v - q_v|`` of the first-token softmaxes
  (:func:`sur_lab.analysis.scoring.first_token_tv`);
- ``nr_tv``: ``1 - TV(p_a, p_clean) / TV(p_dirty, p_clean)`` (Eq. 14; :func:`nr_tv`);
- ``jsd_reprefill``: ``JSD(p, q) = 1/2 KL(p || m) + 1/2 KL(q || m)``, ``m = (p + q) / 2``, in nats, in
  ``[0, ln 2]`` (:func:`first_token_jsd`);
- ``argmax_agree``: ``argmax_v p_v == argmax_v q_v``, the first index among ties (:func:`argmax_agree`);
- ``logits_identical``: byte equality of the float32 first-logit vectors (appendix 11; :func:`logits_identical`);
- ``sequence_agree``: equality of the generated token-id sequences, EOS excluded (:func:`sequence_agree`);
- ``gold_nll``: ``-1/T sum_t log softmax(z_t)[y_t]`` over the T tokens of the canonical gold answer, teacher-forced
  after the query, in nats per token (appendix 10.2's primary endpoint; :func:`gold_nll`).

The gold answer's ids come from :func:`canonical_answer_ids`, which follows the leading-space convention of the
text that precedes the answer. The NLL of Re-prefill's own greedy continuation (a summed, different endpoint) is
:func:`sur_lab.answer.continuation_nll`. The answer-margin endpoints of issue 26 (:func:`gold_margin`,
:func:`margin_recovery`), with the pooled margin recovery of issue 40 (:func:`pooled_margin_recovery`, a ratio of
sums, the primary form; the per-case median stays as a secondary column of :func:`margin_recovery_table`), the old
value's pull of issue 40 (:func:`old_margin`) and the per-row K/V deviation of a cache from a reference cache
(:func:`row_deviation`, the token view's second shading) close the module.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from scipy.special import rel_entr
from transformers import DynamicCache

from sur_lab.analysis.scoring import _as_float64, _softmax64
from sur_lab.cache_ops import cache_length, layer_deviation, num_layers, to_tensors
from sur_lab.checks import as_count

#: Upper bound of the Jensen-Shannon divergence in nats (natural logarithm): ``ln 2``.
JSD_MAX = math.log(2.0)


def nr_tv(tv_method: float, tv_dirty: float) -> float:
    """Normalized first-token recovery ``NR_TV(a) = 1 - TV(p_a, p_clean) / TV(p_dirty, p_clean)`` (Eq. 14).

    Formed per case; not clipped (a method farther from the clean distribution than Dirty is negative, one closer than
    Dirty is in (0, 1], Re-prefill itself is 1).

    Args:
        tv_method: TV between the method's and Re-prefill's first-token distributions, in [0, 1].
        tv_dirty: TV between Dirty's and Re-prefill's first-token distributions, in [0, 1].

    Returns:
        The ratio, or NaN when ``tv_dirty`` is 0 (undefined; Eq. 14) or either input is NaN.

    Raises:
        ValueError: if an input is outside [0, 1] (NaN allowed).
    """
    for name, value in (("tv_method", tv_method), ("tv_dirty", tv_dirty)):
        if not math.isnan(value) and not 0.0 <= value <= 1.0 + 1e-12:
            raise ValueError(f"{name} must be a total variation in [0, 1]; got {value!r}")
    if math.isnan(tv_method) or math.isnan(tv_dirty) or tv_dirty == 0.0:
        return float("nan")
    return 1.0 - tv_method / tv_dirty


def reference_continuation(token_ids, max_tokens: int | None = None) -> list[int]:
    """The greedy continuation whose NLL every method is scored on: Re-prefill's generated ids (EOS excluded, as
    :class:`sur_lab.answer.Answer` stores them), optionally truncated to ``max_tokens``.

    Raises:
        TypeError: if ``max_tokens`` is not an integer (``1.5`` is not rounded).
        ValueError: if ``max_tokens`` < 1.
    """
    if max_tokens is not None:
        max_tokens = as_count(max_tokens, "max_tokens", minimum=1)
    ids = [int(t) for t in token_ids]
    return ids if max_tokens is None else ids[:max_tokens]


# ---------------------------------------------------------------------------------------------------------------------
# First-token distribution and continuation agreement (appendix 10.3, Table 16; appendix 11, Table 17)


def _pair64(p_logits: Any, q_logits: Any) -> tuple[np.ndarray, np.ndarray]:
    p = _as_float64(p_logits, "p_logits")
    q = _as_float64(q_logits, "q_logits")
    if p.shape != q.shape:
        raise ValueError(f"p_logits and q_logits vocab sizes differ: {p.shape[0]} vs {q.shape[0]}")
    return p, q


def first_token_jsd(p_logits: Any, q_logits: Any) -> float:
    """Jensen-Shannon divergence between the next-token distributions of two first-token logit vectors (Table 16).

    ``JSD(p, q) = 1/2 KL(p || m) + 1/2 KL(q || m)`` with ``m = (p + q) / 2``, ``p = softmax(p_logits)``,
    ``q = softmax(q_logits)``, natural logarithm: the value is in nats, symmetric, and lies in ``[0, ln 2]``
    (:data:`JSD_MAX`); it is 0 iff the distributions are equal. Terms with ``p_v = 0`` contribute 0
    (``scipy.special.rel_entr``). Computed in float64 whatever the input dtype, as
    :func:`sur_lab.analysis.scoring.first_token_tv` is. The square root is the Jensen-Shannon *distance* of
    ``scipy.spatial.distance.jensenshannon``; this function returns the divergence itself.

    Args:
        p_logits, q_logits: logits of shape (vocab,) (or with leading size-1 dims); numpy arrays, torch tensors on any
            device and dtype, or sequences.

    Returns:
        JSD in nats, clipped to ``[0, ln 2]`` against float64 rounding (the clip moves the value by at most a few ulp).

    Raises:
        ValueError: naming ``p_logits``/``q_logits`` when a shape is not (vocab,), the vocab sizes differ, or a vector
            has no finite maximum.
    """
    p_raw, q_raw = _pair64(p_logits, q_logits)
    p = _softmax64(p_raw, "p_logits")
    q = _softmax64(q_raw, "q_logits")
    m = 0.5 * (p + q)
    jsd = 0.5 * float(rel_entr(p, m).sum()) + 0.5 * float(rel_entr(q, m).sum())
    return min(max(jsd, 0.0), JSD_MAX)


def argmax_agree(p_logits: Any, q_logits: Any) -> bool:
    """Whether two first-token logit vectors have the same argmax (the greedy first token; Tables 16-17).

    Ties resolve to the lowest token id (``numpy.argmax``; ``torch.argmax`` on a CPU float tensor does the same), so
    two vectors that are byte-identical always agree.

    Raises:
        ValueError: naming ``p_logits``/``q_logits`` when a shape is not (vocab,) or the vocab sizes differ.
    """
    p, q = _pair64(p_logits, q_logits)
    return int(np.argmax(p)) == int(np.argmax(q))


def _float32_bytes(logits: Any, name: str) -> bytes:
    if hasattr(logits, "detach"):  # torch.Tensor: bfloat16/float16 widen to float32 exactly; float64 is refused
        t = logits.detach().cpu()
        if t.dtype == torch.float64:
            raise ValueError(f"{name} is float64; logits_identical compares the recorded float32 vectors")
        arr = t.float().numpy()
    else:
        arr = np.asarray(logits)
        if arr.dtype == np.float64:
            raise ValueError(f"{name} is float64; logits_identical compares the recorded float32 vectors")
        arr = arr.astype(np.float32, copy=False)
    while arr.ndim > 1 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must have shape (vocab,) (leading size-1 dims allowed), got {np.shape(logits)}")
    return np.ascontiguousarray(arr, dtype="<f4").tobytes()


def logits_identical(p_logits: Any, q_logits: Any) -> bool:
    """Byte equality of two first-token logit vectors as float32 (appendix 11, "exact-logit agreement").

    Not tolerance-based closeness: one differing bit anywhere in the vocabulary makes the vectors different (so
    ``-0.0`` and ``0.0`` differ; two NaNs with the same bit pattern agree). bfloat16 and float16 inputs widen to float32
    exactly before the comparison.

    Args:
        p_logits, q_logits: ``(vocab,)`` float32 (or bfloat16/float16) logits, e.g.
            :attr:`sur_lab.answer.Answer.first_token_logits`; torch tensors or numpy arrays.

    Returns:
        ``True`` iff the little-endian float32 bytes are equal (vectors of different lengths are unequal).

    Raises:
        ValueError: naming ``p_logits``/``q_logits`` when a vector is float64 (it would have to be rounded first) or
            its shape is not (vocab,).
    """
    return _float32_bytes(p_logits, "p_logits") == _float32_bytes(q_logits, "q_logits")


def logits_digest(logits: Any) -> str:
    """SHA-256 (hex) of a first-token logit vector's little-endian float32 bytes, for storing in a record.

    Two vectors have equal digests iff :func:`logits_identical` holds (up to a SHA-256 collision).

    Raises:
        ValueError: as :func:`logits_identical`, naming ``logits``.
    """
    return hashlib.sha256(_float32_bytes(logits, "logits")).hexdigest()


def _ids(seq: Any, name: str) -> tuple[int, ...]:
    if hasattr(seq, "detach"):
        seq = seq.detach().cpu().reshape(-1).tolist()
    if isinstance(seq, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of token ids, not text")
    out = []
    for t in seq:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or int(t) < 0:
            raise ValueError(f"{name} must hold non-negative integer token ids; got {t!r}")
        out.append(int(t))
    return tuple(out)


def sequence_agree(a_ids: Sequence[int], b_ids: Sequence[int]) -> bool:
    """Whether two greedy continuations generated the same token ids (sequence agreement, Tables 16-17).

    Compares token ids, not decoded or normalised text (unlike :func:`sur_lab.analysis.scoring.agreement`). Both
    sequences should come from decodes with the same ``max_new_tokens`` and EOS excluded, as
    :attr:`sur_lab.answer.Answer.token_ids` stores them: two decodes that differ only after the limit agree.

    Args:
        a_ids, b_ids: generated token ids (sequences, numpy arrays or 1-D tensors).

    Returns:
        ``True`` iff the sequences are equal element by element and of equal length.

    Raises:
        ValueError: naming ``a_ids``/``b_ids`` when an element is not a non-negative integer, or the input is a str.
    """
    return _ids(a_ids, "a_ids") == _ids(b_ids, "b_ids")


def gold_nll(logits: Any, gold_ids: Sequence[int]) -> float:
    """Mean teacher-forced negative log-probability of the canonical gold answer (appendix 10.2's primary endpoint).

    ``NLL = -(1/T) sum_{t=0}^{T-1} log softmax(z_t)[y_t]``, where ``y = gold_ids`` are the T tokens of the canonical
    answer (:func:`canonical_answer_ids`) and ``z_t`` is the logit vector that predicts ``y_t``: ``z_0`` the logits
    after the query (the first-token logits), ``z_t`` for ``t >= 1`` the logits after the query and
    ``y_0 .. y_{t-1}`` (teacher forcing). Every answer token counts, with equal weight; no EOS token is added.
    Computed in float64 (``log_softmax`` of the upcast logits). Units: nats per answer token.

    Args:
        logits: ``(T, vocab)`` teacher-forced logits, row t predicting ``gold_ids[t]``; numpy or torch, any float dtype.
        gold_ids: the T >= 1 gold token ids.

    Returns:
        The mean NLL in nats (>= 0).

    Raises:
        ValueError: naming ``gold_ids`` when empty, not integer ids, or an id is outside ``[0, vocab)``; naming
            ``logits`` when its shape is not ``(len(gold_ids), vocab)`` or a row has no finite maximum.
    """
    y = np.asarray(_ids(gold_ids, "gold_ids"), dtype=np.int64)
    if y.size == 0:
        raise ValueError("gold_ids is empty; the canonical answer must have at least one token")
    if hasattr(logits, "detach"):
        logits = logits.detach().cpu().double().numpy()
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 2 or z.shape[0] != y.size:
        raise ValueError(f"logits must have shape (len(gold_ids)={y.size}, vocab); got {tuple(z.shape)}")
    if int(y.max()) >= z.shape[1]:
        raise ValueError(f"gold_ids holds id {int(y.max())} outside the vocabulary [0, {z.shape[1]})")
    top = z.max(axis=1, keepdims=True)
    if not np.all(np.isfinite(top)):
        raise ValueError("logits has a row without a finite maximum (all -inf, +inf or NaN)")
    shifted = z - top
    log_z = np.log(np.exp(shifted).sum(axis=1))
    logp = shifted[np.arange(y.size), y] - log_z
    return float(-logp.mean())


def canonical_answer_ids(tokenizer, answer: str, preceding_text: str) -> list[int]:
    """Token ids of the canonical gold answer as the model would generate it right after ``preceding_text``.

    The answer is stripped and tokenized on its own (no special tokens), like every token segment of an edit
    (:func:`sur_lab.edits.tokenize_segments`). Leading-space convention: when ``preceding_text`` ends in whitespace
    (a chat template's generation prompt ends in ``"assistant\n"``; natural-QA and evidence-location queries do) the
    answer starts without a space; otherwise (a completion prompt ending in ``"Answer:"``) it gets one leading
    space, as byte-level BPE vocabularies spell a word that follows a word or colon (``" Paris"``).

    Args:
        tokenizer: a fast tokenizer.
        answer: the canonical answer text (:attr:`sur_lab.data.qa.QAExample.answer`).
        preceding_text: the text right before the answer (the query text of the edit, or its last characters).

    Returns:
        The T >= 1 answer token ids.

    Raises:
        ValueError: naming ``answer`` when it is empty after stripping or produces no token.
    """
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"answer={answer!r} must be a non-empty string")
    text = answer.strip()
    if preceding_text and not preceding_text[-1].isspace():
        text = " " + text
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"answer={answer!r} produces no token")
    return ids


# ---------------------------------------------------------------------------------------------------------------------
# Answer-margin endpoints (issue 26): the gold answer's first-token margin and its recovery between Shift and Re-prefill


def gold_margin(logits, gold_token: int) -> float:
    """The gold answer's margin at the first answer step: ``z[g] - max_{v != g} z[v]`` (issue 26).

    ``logits`` are the first-token logits after the query (the first answer step; teacher forcing is trivial there:
    nothing has been generated yet), ``g`` the gold answer's first token. Positive when the gold token is the argmax,
    by how much; negative when another token leads, by how much. Computed in float64.

    Args:
        logits: ``(vocab,)`` logits (leading size-1 dims allowed), a numpy array, torch tensor (any device and dtype)
            or sequence; every entry finite.
        gold_token: the gold answer's first token id, an integer in ``[0, vocab)``.

    Returns:
        The margin in logit units (nats of log-odds against the strongest competitor).

    Raises:
        ValueError: naming ``logits`` when its shape is not ``(vocab,)``, it has fewer than two entries or a
            non-finite entry; naming ``gold_token`` when it is not an integer in ``[0, vocab)``.
    """
    z = _margin_logits(logits, {"gold_token": gold_token}, competitor=True)
    g = int(gold_token)
    others = np.delete(z, g)
    return float(z[g] - others.max())


def old_margin(logits, old_token: int, gold_token: int) -> float:
    """The superseded value's pull at the first answer step: ``z[o] - z[g]``, the logit of the old value's first
    token minus the gold value's (issue 40).

    Positive when the greedy first step prefers the old value to the gold one (a stale first token when ``o`` is the
    argmax), negative when the gold leads; continuous where the stale-answer rate is 0, so it shows whether a
    repair's states pull toward the old value even when the greedy answer is right. Computed in float64.

    Args:
        logits: ``(vocab,)`` first-token logits after the query (leading size-1 dims allowed), a numpy array, torch
            tensor (any device and dtype) or sequence; every entry finite.
        old_token: the superseded value's first token id, an integer in ``[0, vocab)``.
        gold_token: the gold value's first token id, an integer in ``[0, vocab)``.

    Returns:
        The difference in logit units (the log-odds of the old first token against the gold one).

    Raises:
        ValueError: naming ``logits`` when its shape is not ``(vocab,)`` or it has a non-finite entry; naming
            ``old_token`` / ``gold_token`` when it is not an integer in ``[0, vocab)``.
    """
    z = _margin_logits(logits, {"old_token": old_token, "gold_token": gold_token})
    return float(z[int(old_token)] - z[int(gold_token)])


def _margin_logits(logits, tokens: dict[str, Any], *, competitor: bool = False) -> np.ndarray:
    """The margins' one input check (:func:`gold_margin`, :func:`old_margin`): ``logits`` as float64 ``(vocab,)``
    (at least two entries with ``competitor``), all finite, and each of ``tokens`` (name: id) an integer in
    ``[0, vocab)``.

    Raises:
        ValueError: naming ``logits`` (shape, too few entries, a non-finite entry) or the token's name.
    """
    z = _as_float64(logits, "logits")
    if competitor and z.size < 2:
        raise ValueError(f"logits must have at least two entries (a gold token and a competitor); got {z.size}")
    if not np.isfinite(z).all():
        raise ValueError("logits has a non-finite entry (inf or NaN); a margin needs finite logits")
    for name, tok in tokens.items():
        if isinstance(tok, (bool, np.bool_)) or not isinstance(tok, (int, np.integer)):
            raise ValueError(f"{name} must be an integer token id; got {tok!r}")
        if not 0 <= int(tok) < z.size:
            raise ValueError(f"{name}={int(tok)} is outside [0, {z.size}) (the vocabulary of logits)")
    return z


def margin_recovery(m_method: float, m_shift: float, m_reprefill: float) -> float:
    """Answer-margin recovery of a method, per case: ``(m_method - m_Shift) / (m_Re-prefill - m_Shift)`` (issue 26).

    0 is Shift's margin, 1 is Re-prefill's; never clipped (a method below Shift is negative, one beyond Re-prefill is
    above 1).

    Args:
        m_method, m_shift, m_reprefill: :func:`gold_margin` of the method, Shift and Re-prefill on the same case.

    Returns:
        The ratio, or NaN (undefined) when ``m_reprefill == m_shift`` or any input is NaN.

    Raises:
        ValueError: naming the argument that is infinite or not a real number.
    """
    checked = []
    for name, value in (("m_method", m_method), ("m_shift", m_shift), ("m_reprefill", m_reprefill)):
        try:
            x = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a real number; got {value!r}") from None
        if isinstance(value, bool) or math.isinf(x):
            raise ValueError(f"{name} must be a finite real number (or NaN); got {value!r}")
        checked.append(x)
    m, s, r = checked
    if math.isnan(m) or math.isnan(s) or math.isnan(r) or r == s:
        return float("nan")
    return (m - s) / (r - s)


#: The pooled margin recovery (:func:`pooled_margin_recovery`) is undefined when Re-prefill's mean gold-margin gain
#: over Shift, ``sum(m_Re-prefill - m_Shift) / n``, is below this many logits: a smaller gain is within the numerical
#: disagreement of two exact paths (the paper's Table 17: cross-path |dNLL| excess up to 0.20 nats, Qwen3-30B-A3B), so
#: the ratio would divide by noise.
MARGIN_RECOVERY_MIN_GAP = 0.2


def pooled_margin_recovery(m_method, m_shift, m_reprefill, *, min_gap: float = MARGIN_RECOVERY_MIN_GAP
                           ) -> tuple[float, str]:
    """Answer-margin recovery of a method over a set of cases, as a ratio of sums (issue 40): ``sum(m - m_Shift) /
    sum(m_Re-prefill - m_Shift)``. 0 is Shift's, 1 is Re-prefill's; never clipped. Unlike the per-case ratio
    (:func:`margin_recovery`), a case where Shift ties Re-prefill still counts (in the numerator), and one case with a
    tiny denominator cannot dominate: each case weighs by Re-prefill's gain on it.

    Args:
        m_method, m_shift, m_reprefill: :func:`gold_margin` per case, aligned 1-D sequences of equal length; a case
            with a NaN in any of the three is left out.
        min_gap: the threshold (logits, >= 0) on the mean denominator per case (default
            :data:`MARGIN_RECOVERY_MIN_GAP`).

    Returns:
        ``(ratio, reason)``: ``reason`` is ``""`` when defined; else the ratio is NaN and ``reason`` says why (no case
        with all three margins, or the mean gain below ``min_gap``).

    Raises:
        ValueError: naming the argument that is not 1-D, differs in length, holds an infinite value, or ``min_gap``
            when negative or not finite.
    """
    ratio, reason, _ = _pooled_recovery(m_method, m_shift, m_reprefill, min_gap)
    return ratio, reason


def _pooled_recovery(m_method, m_shift, m_reprefill, min_gap: float) -> tuple[float, str, int]:
    """:func:`pooled_margin_recovery` and the count of cases it pooled (those with all three margins)."""
    arrays = []
    for name, value in (("m_method", m_method), ("m_shift", m_shift), ("m_reprefill", m_reprefill)):
        x = np.asarray(value, dtype=np.float64)
        if x.ndim != 1:
            raise ValueError(f"{name} must be a 1-D sequence of margins; got shape {x.shape}")
        if np.isinf(x).any():
            raise ValueError(f"{name} holds an infinite margin")
        arrays.append(x)
    m, s, r = arrays
    if not (m.size == s.size == r.size):
        raise ValueError(f"m_method, m_shift and m_reprefill must have one margin per case; got {m.size}, {s.size} "
                         f"and {r.size}")
    if isinstance(min_gap, bool) or not isinstance(min_gap, (int, float)) or not (math.isfinite(min_gap)
                                                                                  and min_gap >= 0):
        raise ValueError(f"min_gap={min_gap!r} must be a finite number >= 0")
    keep = ~(np.isnan(m) | np.isnan(s) | np.isnan(r))
    n = int(keep.sum())
    if n == 0:
        return float("nan"), "undefined: no case has the method's, Shift's and Re-prefill's margins", 0
    gap = float(np.sum(r[keep] - s[keep]))
    if gap / n < min_gap or gap <= 0:
        return float("nan"), (f"undefined: Re-prefill's mean margin gain over Shift is {gap / n:.3g} logits over "
                              f"{n} case{'s' if n != 1 else ''}, below the {min_gap:g} threshold"), n
    return float(np.sum(m[keep] - s[keep]) / gap), "", n


def _reference_margins(records, margin: str) -> dict[str, dict]:
    """Shift's and Re-prefill's margin per case of ``records``: ``{"Shift": {case: m}, "Re-prefill": {case: m}}``.

    Raises:
        ValueError: naming ``records`` when a column is missing or a case lacks (or repeats) its Shift or Re-prefill
            record.
    """
    missing = [c for c in ("case_id", "method", margin) if c not in records.columns]
    if missing:
        raise ValueError(f"records lack the columns {missing}")
    refs = {}
    for ref in ("Shift", "Re-prefill"):
        rows = records[records["method"] == ref]
        counts = rows["case_id"].value_counts()
        lacking = sorted(set(records["case_id"]) - set(counts.index))
        repeated = sorted(counts.index[counts > 1])
        if lacking or repeated:
            raise ValueError(f"records: every case needs exactly one {ref!r} record; "
                             f"missing for {lacking[:3]}, repeated for {repeated[:3]}")
        refs[ref] = dict(zip(rows["case_id"], rows[margin].astype(float)))
    return refs


def add_margin_recovery(records, *, margin: str = "gold_margin", out: str = "margin_recovery"):
    """Sweep records with a ``margin_recovery`` column: each record's per-case :func:`margin_recovery` against the
    same case's Shift and Re-prefill records (the secondary, per-case form; :func:`margin_recovery_table` pools them).

    Args:
        records: a DataFrame with one row per (case, method, budget): ``case_id``, ``method`` and ``margin``; each case
            has exactly one ``"Shift"`` and one ``"Re-prefill"`` row.
        margin: the column holding :func:`gold_margin`.
        out: the new column's name.

    Returns:
        A new DataFrame (``records`` is not modified); NaN where the ratio is undefined.

    Raises:
        ValueError: naming ``records`` when a column is missing, or when a case lacks (or repeats) its Shift or
            Re-prefill record.
    """
    refs = _reference_margins(records, margin)
    ratios = [
        margin_recovery(float(m), refs["Shift"][c], refs["Re-prefill"][c])
        for c, m in zip(records["case_id"], records[margin])
    ]
    return records.assign(**{out: ratios})


def margin_recovery_table(records, *, margin: str = "gold_margin", value: str = "margin_recovery",
                          by=("method", "budget_pct"), min_gap: float = MARGIN_RECOVERY_MIN_GAP):
    """Margin recovery per ``by`` group (issues 26 and 40): the pooled ratio of sums (:func:`pooled_margin_recovery`,
    the primary form) and the median of the defined per-case ratios with their count (the secondary form).

    Undefined per-case ratios (NaN) are left out of the median and counted apart; a group with no defined ratio has a
    NaN median. Reference methods (``budget_pct`` NaN) form their own groups.

    Args:
        records: a DataFrame with the ``by`` columns, ``case_id``, ``method``, ``margin`` and ``value`` (e.g. from
            :func:`add_margin_recovery`); each case has one Shift and one Re-prefill record.
        margin: the column holding :func:`gold_margin`.
        value: the per-case ratio column.
        by: grouping columns.
        min_gap: as :func:`pooled_margin_recovery`.

    Returns:
        DataFrame indexed by ``by`` with ``ratio`` (pooled; NaN when undefined), ``median``, ``n_defined`` (ratios in
        the median), ``n_pooled`` (cases in the ratio), ``n_cases`` (records) and ``note`` (why ``ratio`` is
        undefined; ``""`` when defined).

    Raises:
        ValueError: naming ``records`` when a column is missing or a case lacks its Shift or Re-prefill record; as
            :func:`pooled_margin_recovery`.
    """
    by = list(by)
    missing = [c for c in [*by, value] if c not in records.columns]
    if missing:
        raise ValueError(f"records lack the columns {missing}")
    refs = _reference_margins(records, margin)
    df = records.assign(_v=records[value].astype(float), _m=records[margin].astype(float),
                        _s=records["case_id"].map(refs["Shift"]).astype(float),
                        _r=records["case_id"].map(refs["Re-prefill"]).astype(float))
    rows = []
    for key, g in df.groupby(by, dropna=False, sort=False):
        ratio, note, pooled = _pooled_recovery(g["_m"].to_numpy(), g["_s"].to_numpy(), g["_r"].to_numpy(), min_gap)
        rows.append((*(key if isinstance(key, tuple) else (key,)), ratio, float(g["_v"].median()),
                     int(g["_v"].count()), pooled, len(g), note))
    table = pd.DataFrame(rows, columns=[*by, "ratio", "median", "n_defined", "n_pooled", "n_cases", "note"])
    return table.set_index(by)


def row_deviation(cache: DynamicCache, reference: DynamicCache) -> np.ndarray:
    """Relative K/V deviation of ``cache`` from ``reference`` per row, over all layers, KV heads and head dimensions.

    Row j: ``sqrt(Σ_l ‖K_l[j] − K_l^ref[j]‖² + ‖V_l[j] − V_l^ref[j]‖²) / sqrt(Σ_l ‖K_l^ref[j]‖² + ‖V_l^ref[j]‖²)``,
    computed in float64; neither cache is modified.

    Args:
        cache: an ``n``-row cache (Shift, a repaired cache, a session's live cache).
        reference: a cache of the same ``n`` rows (Re-prefill's: a clean prefill of the same tokens).

    Returns:
        float64 ``[n]``.

    Raises:
        ValueError: naming ``cache`` when its row or layer count differs from ``reference``'s.
    """
    if cache_length(cache) != cache_length(reference) or num_layers(cache) != num_layers(reference):
        raise ValueError(f"cache has {cache_length(cache)} rows and {num_layers(cache)} layers; reference has "
                         f"{cache_length(reference)} and {num_layers(reference)}")
    num = layer_deviation(cache, reference).sum(dim=0)  # [n]
    den = sum((kr[0].double().pow(2) + vr[0].double().pow(2)).sum(dim=(0, 2)) for kr, vr in to_tensors(reference))
    return (num / den).sqrt().cpu().numpy()
