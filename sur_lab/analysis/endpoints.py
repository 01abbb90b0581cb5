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
