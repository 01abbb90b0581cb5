"""Per-record fidelity endpoints beyond exact match: normalized first-token recovery (Eq. 14, appendix 10.3–11).

First-token total variation itself is :func:`sur_lab.analysis.scoring.first_token_tv`; the NLL of Re-prefill's greedy
continuation is :func:`sur_lab.answer.continuation_nll`. This module adds the normalized recovery ratio and the
continuation that the NLL scores.
"""

from __future__ import annotations

import math

from sur_lab.checks import as_count


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
    import numpy as np

    from sur_lab.analysis.scoring import _as_float64

    z = _as_float64(logits, "logits")
    if z.size < 2:
        raise ValueError(f"logits must have at least two entries (a gold token and a competitor); got {z.size}")
    if not np.isfinite(z).all():
        raise ValueError("logits has a non-finite entry (inf or NaN); a margin needs finite logits")
    if isinstance(gold_token, (bool, np.bool_)) or not isinstance(gold_token, (int, np.integer)):
        raise ValueError(f"gold_token must be an integer token id; got {gold_token!r}")
    if not 0 <= int(gold_token) < z.size:
        raise ValueError(f"gold_token={int(gold_token)} is outside [0, {z.size}) (the vocabulary of logits)")
    g = int(gold_token)
    others = np.delete(z, g)
    return float(z[g] - others.max())


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


def add_margin_recovery(records, *, margin: str = "gold_margin", out: str = "margin_recovery"):
    """Sweep records with a ``margin_recovery`` column: each record's :func:`margin_recovery` against the same case's
    Shift and Re-prefill records.

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
    ratios = [
        margin_recovery(float(m), refs["Shift"][c], refs["Re-prefill"][c])
        for c, m in zip(records["case_id"], records[margin])
    ]
    return records.assign(**{out: ratios})


def margin_recovery_table(records, *, value: str = "margin_recovery", by=("method", "budget_pct")):
    """Medians of the defined margin-recovery ratios with their count (issue 26), one row per ``by`` group.

    Undefined ratios (NaN) are left out of the median and counted apart; a group with no defined ratio has a NaN
    median. Reference methods (``budget_pct`` NaN) form their own groups.

    Args:
        records: a DataFrame with the ``by`` columns and ``value`` (e.g. from :func:`add_margin_recovery`).
        value: the ratio column.
        by: grouping columns.

    Returns:
        DataFrame indexed by ``by`` with ``median``, ``n_defined`` (ratios in the median) and ``n_cases`` (records).

    Raises:
        ValueError: naming ``records`` when ``value`` or a ``by`` column is missing.
    """
    by = list(by)
    missing = [c for c in [*by, value] if c not in records.columns]
    if missing:
        raise ValueError(f"records lack the columns {missing}")
    grouped = records.assign(_v=records[value].astype(float)).groupby(by, dropna=False, sort=False)["_v"]
    table = grouped.agg(median="median", n_defined="count", n_cases="size")
    return table.astype({"n_defined": int, "n_cases": int})
