"""Proposition 14.1 (appendix 14, Eq. 25-28) on tensors, and the tables of its terms.

* **Proposition 14.1 on tensors.** :func:`mixed_cache_bound` evaluates, for one attention head and a set of query rows,
  the left side ``‖o_i^A − o_i^⋆‖₂``, both terms of Eq. 25 with ``M_V``, the intermediate Eq. 27, the logit bound of
  Eq. 26 with ``Q^⋆`` and ``K^⋆``, and the fixed-attention approximation Eq. 28, all in float64;
  :func:`bound_rounding_allowance` is the float64 rounding a violation must exceed to count.
* **Tables.** :func:`bound_summary` (where Eq. 25 and Eq. 26 hold, and the slack) and :func:`eq28_table` (Eq. 28
  against the left side) summarize the rows that :func:`~sur_lab.studies.theory.capture.bound_study` measures on a
  real model (:mod:`~sur_lab.studies.theory.capture`).

Scaling: the paper writes logits as ``⟨q, k⟩ / √d_h``; the model's attention modules carry their own ``scaling``
(``d_h^{-1/2}`` for Llama, Mistral, Qwen2 and Qwen3), which is what the capture records and the bound uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

# ---------------------------------------------------------------------------------------------------------------------
# Proposition 14.1 on tensors


@dataclass(frozen=True)
class BoundTerms:
    """Terms of Proposition 14.1 for a set of query rows of one or more heads (appendix 14).

    Every field is a float64 tensor of shape ``[..., n]`` (the leading shape of the inputs, n query rows).

    Attributes:
        lhs: ``‖o_i^A − o_i^⋆‖₂``, the left side.
        value_term: ``Σ_{j≤i} α_ij^A ‖Δv_j‖₂``, the first term of Eq. 25 and Eq. 27.
        m_v: ``M_V = max_{j≤i} ‖v_j^⋆‖₂`` (the smallest constant satisfying the proposition's assumption).
        logit_dev: ``‖z_i^A − z_i^⋆‖_∞`` over the causal keys ``j ≤ i``.
        logit_term: ``2 M_V ‖z_i^A − z_i^⋆‖_∞``, the second term of Eq. 25.
        bound25: ``value_term + logit_term`` (Eq. 25).
        alpha_l1: ``‖α_i^A − α_i^⋆‖₁``.
        bound27: ``value_term + M_V ‖α_i^A − α_i^⋆‖₁`` (Eq. 27, the step before the softmax Lipschitz bound).
        q_ref_norm: ``Q^⋆ = ‖q_i^⋆‖₂``.
        k_ref_max: ``K^⋆ = max_{j≤i} ‖k_j^⋆‖₂``.
        dq_norm: ``‖Δq_i‖₂``.
        dk_max: ``max_{j≤i} ‖Δk_j‖₂``.
        logit_bound26: ``scaling · (K^⋆ ‖Δq_i‖ + (Q^⋆ + ‖Δq_i‖) max_{j≤i} ‖Δk_j‖)`` (Eq. 26).
        bound25_26: ``value_term + 2 M_V · logit_bound26`` (Eq. 25 with Eq. 26 substituted).
        approx28: ``Σ_{j≤i} α_ij^⋆ ‖Δv_j‖₂``, the fixed-attention approximation (Eq. 28).
        o_a: ``[..., n, d_h]`` attention output under A.
        o_ref: ``[..., n, d_h]`` attention output under ⋆.
    """

    lhs: torch.Tensor
    value_term: torch.Tensor
    m_v: torch.Tensor
    logit_dev: torch.Tensor
    logit_term: torch.Tensor
    bound25: torch.Tensor
    alpha_l1: torch.Tensor
    bound27: torch.Tensor
    q_ref_norm: torch.Tensor
    k_ref_max: torch.Tensor
    dq_norm: torch.Tensor
    dk_max: torch.Tensor
    logit_bound26: torch.Tensor
    bound25_26: torch.Tensor
    approx28: torch.Tensor
    o_a: torch.Tensor = field(repr=False)
    o_ref: torch.Tensor = field(repr=False)

    #: Per-row scalar fields, in table order.
    SCALARS = (
        "lhs", "value_term", "m_v", "logit_dev", "logit_term", "bound25", "alpha_l1", "bound27", "q_ref_norm",
        "k_ref_max", "dq_norm", "dk_max", "logit_bound26", "bound25_26", "approx28",
    )


def causal_attention_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention of selected query rows, in float64, without forming an ``N × N`` matrix.

    Args:
        q: ``[..., n, d_h]`` queries (post-RoPE), any float dtype.
        k: ``[..., N, d_h]`` keys (post-RoPE) of the whole cache.
        v: ``[..., N, d_h]`` values.
        positions: ``[n]`` int64 absolute row index of each query; query r reads keys ``0 .. positions[r]``.
        scaling: logit scale (``d_h^{-1/2}`` in the paper).

    Returns:
        ``(o [..., n, d_h], alpha [..., n, N], z [..., n, N])`` float64, with ``alpha = 0`` and ``z = 0`` at masked
        (future) keys.
    """
    q, k, v = q.double(), k.double(), v.double()
    n_keys = k.shape[-2]
    mask = torch.arange(n_keys, device=k.device)[None, :] <= positions.to(k.device)[:, None]  # [n, N]
    z = torch.einsum("...nd,...kd->...nk", q, k) * float(scaling)
    alpha = torch.softmax(z.masked_fill(~mask, float("-inf")), dim=-1)
    return alpha @ v, alpha, z.masked_fill(~mask, 0.0)


def mixed_cache_bound(
    q_a: torch.Tensor,
    k_a: torch.Tensor,
    v_a: torch.Tensor,
    q_ref: torch.Tensor,
    k_ref: torch.Tensor,
    v_ref: torch.Tensor,
    positions: torch.Tensor | Sequence[int],
    scaling: float | None = None,
) -> BoundTerms:
    """Every term of Proposition 14.1 (Eq. 25–28, appendix 14) for query rows of one or more heads, in float64.

    For query row r at absolute position ``i = positions[r]``, the keys/values ``0 .. i`` of each cache are read
    (``j ≤ i``); later rows are masked. Superscript A is the mixed (sparse-refreshed) cache, ⋆ full-suffix Replay.

    Args:
        q_a: ``[..., n, d_h]`` queries under A (fresh q of refreshed positions).
        k_a: ``[..., N, d_h]`` keys of cache A (post-RoPE); ``v_a`` its values, same shape.
        q_ref: ``[..., n, d_h]`` queries under Replay.
        k_ref: ``[..., N, d_h]`` keys of the Replay cache; ``v_ref`` its values.
        positions: ``[n]`` absolute rows of the queries, each in ``[0, N)``.
        scaling: logit scale; ``None`` = ``d_h^{-1/2}`` (the paper's ``1/√d_h``).

    Returns:
        :class:`BoundTerms` (float64). In exact arithmetic ``lhs ≤ bound27 ≤ bound25 ≤ bound25_26`` and
        ``logit_dev ≤ logit_bound26``.

    Raises:
        ValueError: naming the argument whose shape does not match, or ``positions`` outside ``[0, N)``.
    """
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    if q_a.shape != q_ref.shape:
        raise ValueError(f"q_a shape {tuple(q_a.shape)} != q_ref shape {tuple(q_ref.shape)}")
    for name, t in (("v_a", v_a), ("k_ref", k_ref), ("v_ref", v_ref)):
        if t.shape != k_a.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != k_a shape {tuple(k_a.shape)}")
    if q_a.shape[-1] != k_a.shape[-1] or q_a.shape[:-2] != k_a.shape[:-2]:
        raise ValueError(f"q_a shape {tuple(q_a.shape)} does not match k_a shape {tuple(k_a.shape)} ([..., n|N, d_h])")
    if q_a.shape[-2] != positions.numel():
        raise ValueError(f"positions has {positions.numel()} entries; q_a has {q_a.shape[-2]} rows")
    n_keys = k_a.shape[-2]
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= n_keys):
        raise ValueError(f"positions must lie in [0, {n_keys}); got {int(positions.min())}..{int(positions.max())}")
    if scaling is None:
        scaling = q_a.shape[-1] ** -0.5
    o_a, alpha_a, z_a = causal_attention_rows(q_a, k_a, v_a, positions, scaling)
    o_ref, alpha_ref, z_ref = causal_attention_rows(q_ref, k_ref, v_ref, positions, scaling)
    dv = (v_a.double() - v_ref.double()).norm(dim=-1)  # [..., N]
    dk = (k_a.double() - k_ref.double()).norm(dim=-1)
    # Running maxima over keys, read at each query's own position: max_{j ≤ i}.
    causal_max = lambda x: x.cummax(dim=-1).values[..., positions]  # noqa: E731
    m_v = causal_max(v_ref.double().norm(dim=-1))
    k_ref_max = causal_max(k_ref.double().norm(dim=-1))
    dk_max = causal_max(dk)
    value_term = (alpha_a * dv[..., None, :]).sum(-1)
    approx28 = (alpha_ref * dv[..., None, :]).sum(-1)
    logit_dev = (z_a - z_ref).abs().amax(-1)  # masked entries are 0 in both
    alpha_l1 = (alpha_a - alpha_ref).abs().sum(-1)
    q_ref_norm = q_ref.double().norm(dim=-1)
    dq_norm = (q_a.double() - q_ref.double()).norm(dim=-1)
    logit_bound26 = float(scaling) * (k_ref_max * dq_norm + (q_ref_norm + dq_norm) * dk_max)
    # o^A − o^⋆ = Σ α^A Δv + Σ (α^A − α^⋆) v^⋆ (the decomposition of Eq. 27), evaluated in this form rather than as a
    # difference of two outputs: with equal attention the second sum is exactly zero and no cancellation of
    # O(ε‖v‖) rounding hides a small left side.
    diff = alpha_a @ (v_a.double() - v_ref.double()) + (alpha_a - alpha_ref) @ v_ref.double()
    return BoundTerms(
        lhs=diff.norm(dim=-1),
        value_term=value_term,
        m_v=m_v,
        logit_dev=logit_dev,
        logit_term=2.0 * m_v * logit_dev,
        bound25=value_term + 2.0 * m_v * logit_dev,
        alpha_l1=alpha_l1,
        bound27=value_term + m_v * alpha_l1,
        q_ref_norm=q_ref_norm,
        k_ref_max=k_ref_max,
        dq_norm=dq_norm,
        dk_max=dk_max,
        logit_bound26=logit_bound26,
        bound25_26=value_term + 2.0 * m_v * logit_bound26,
        approx28=approx28,
        o_a=o_a,
        o_ref=o_ref,
    )


def bound_rounding_allowance(terms: BoundTerms, num_keys: int | torch.Tensor) -> torch.Tensor:
    """A float64 rounding allowance for comparing ``lhs`` with ``bound25`` (same shape as ``terms.lhs``).

    Both sides are sums over at most ``N = num_keys`` products evaluated in float64; each carries a relative rounding
    error of at most about ``N · ε`` (ε = 2^-52) of the magnitudes summed. The allowance is ``4 N ε`` times the
    magnitude of the quantities involved (``lhs``, ``bound25`` and ``2 M_V``, the scale of a softmax rounding error
    propagated through Eq. 27). A violation larger than this is not a floating-point effect.
    """
    eps = torch.finfo(torch.float64).eps
    scale = terms.lhs + terms.bound25 + 2.0 * terms.m_v
    return 4.0 * torch.as_tensor(num_keys, dtype=torch.float64) * eps * scale


# ---------------------------------------------------------------------------------------------------------------------
# Tables of the bound's terms (rows of sur_lab.studies.theory.capture.bound_study)


def bound_summary(df) -> "pd.DataFrame":  # noqa: F821
    """Fraction of rows and of (label, layer, head) groups where Eq. 25 and Eq. 26 hold, and the slack.

    Returns:
        One-row DataFrame: ``rows, heads, frac_rows_hold, frac_heads_hold, frac_rows_hold_26, violations,
        violations_beyond_rounding, max_violation, median_slack, median_log10_slack, frac_eq28_under`` (Eq. 28 below
        the left side), ``max_capture_err``.
    """
    ok = df[df["lhs"] > 0]
    heads = df.groupby(["label", "layer", "head"])["holds"].all()
    gap = df["lhs"] - df["bound25"]
    return pd.DataFrame([{
        "rows": len(df),
        "heads": len(heads),
        "frac_rows_hold": df["holds"].mean(),
        "frac_heads_hold": heads.mean(),
        "frac_rows_hold_26": df["holds_26"].mean(),
        "violations": int((gap > 0).sum()),
        "violations_beyond_rounding": int((gap > df["allowance"]).sum()),
        "max_violation": float(gap.clip(lower=0).max()),
        "median_slack": float(ok["slack"].median()),
        "median_log10_slack": float(np.log10(ok["slack"]).median()),
        "frac_eq28_under": float((ok["approx28"] < ok["lhs"]).mean()),
        "max_capture_err": float(df["capture_err"].max()),
    }])


def eq28_table(df) -> "pd.DataFrame":  # noqa: F821
    """How the fixed-attention approximation (Eq. 28) compares with the left side, per support label.

    Returns:
        DataFrame indexed by ``label`` with ``rows``, ``under`` (fraction with ``approx28 < lhs``: Eq. 28
        under-estimates, the attention shift adds error), ``over`` (``approx28 > lhs``), ``median_ratio`` and the
        5th / 95th percentiles ``q05``, ``q95`` of ``approx28 / lhs`` (rows with ``lhs > 0``).
    """
    ok = df[df["lhs"] > 0]
    ratio = ok["approx28"] / ok["lhs"]
    g = ratio.groupby(ok["label"])
    return (
        g.size().rename("rows").to_frame()
        .join((ratio < 1).groupby(ok["label"]).mean().rename("under"))
        .join((ratio > 1).groupby(ok["label"]).mean().rename("over"))
        .join(g.median().rename("median_ratio"))
        .join(g.quantile(0.05).rename("q05"))
        .join(g.quantile(0.95).rename("q95"))
    )


__all__ = [
    "BoundTerms",
    "bound_rounding_allowance",
    "bound_summary",
    "causal_attention_rows",
    "eq28_table",
    "mixed_cache_bound",
]
