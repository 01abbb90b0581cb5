"""Proposition 14.1 (appendix 14, Eq. 25-28) made measurable: the mixed-cache error bound on tensors, and the capture
of query vectors and attention outputs on a real model that evaluates it (:func:`bound_study`).

* **Proposition 14.1 on tensors.** :func:`mixed_cache_bound` evaluates, for one attention head and a set of query rows,
  the left side ``‖o_i^A − o_i^⋆‖₂``, both terms of Eq. 25 with ``M_V``, the intermediate Eq. 27, the logit bound of
  Eq. 26 with ``Q^⋆`` and ``K^⋆``, and the fixed-attention approximation Eq. 28, all in float64.
* **Proposition 14.1 on a real model.** :class:`AttentionCapture` records, during ordinary forwards, the query vectors
  (after Q/K normalization and RoPE, exactly as the model's attention function receives them) and the attention outputs
  of sampled layers and heads. :func:`refresh_with_queries` runs the interval-wise ``"sequential"`` executor under the
  capture (cache A and ``q^A`` of every refreshed position); :func:`replay_with_queries` does the same for full-suffix
  Replay (cache ⋆ and ``q^⋆``). Keys and values come from the final caches: in the interval-wise executor an interval
  ``[a, b)`` reads rows ``[0, a)`` that no later interval rewrites, plus its own fresh rows, so the final cache A holds
  exactly the K/V that refreshed position i attended to (likewise for Replay). Only the sampled heads' rows of the
  attention matrix are ever formed (``n_rows × N`` per head); no ``N × N`` matrix is built. :func:`bound_study` joins
  them into one row per (budget, layer, head, refreshed position). :func:`theory_edit` builds the real-context case.

Scaling: the paper writes logits as ``⟨q, k⟩ / √d_h``; the model's attention modules carry their own ``scaling``
(``d_h^{-1/2}`` for Llama, Mistral, Qwen2 and Qwen3), which is what the capture records and the bound uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from sur_lab.attention import attention_hook, native_implementation
from sur_lab.budget import Support
from sur_lab.cache_ops import layer_kv, slice_rows
from sur_lab.checks import as_count
from sur_lab.data.qa import is_held_out, load_corpus, load_example
from sur_lab.edits import EditedContext, chat_edit, format_passages
from sur_lab.executors import check_support, get_executor
from sur_lab.forward import forward_tokens
from sur_lab.models import LoadedModel

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
# Capturing queries and attention outputs on a real model


@dataclass
class CapturedRows:
    """Queries and attention outputs recorded for one layer during forwards.

    Attributes:
        positions: ``[n]`` int64 absolute rows of the recorded queries, in recording order.
        queries: ``[H_s, n, d_h]`` queries of the sampled heads (post-normalization, post-RoPE), model dtype.
        outputs: ``[H_s, n, d_h]`` attention outputs of the sampled heads (before ``o_proj``), model dtype.
        scaling: the module's logit scale.
    """

    positions: torch.Tensor
    queries: torch.Tensor
    outputs: torch.Tensor
    scaling: float

    def rows(self, positions: torch.Tensor | Sequence[int]) -> "CapturedRows":
        """The recorded rows at ``positions`` (absolute), in the order given; the last record wins for repeats.

        Raises:
            ValueError: naming ``positions`` when one was never recorded.
        """
        want = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
        lookup = {int(p): r for r, p in enumerate(self.positions.tolist())}
        missing = [int(p) for p in want.tolist() if int(p) not in lookup]
        if missing:
            raise ValueError(f"positions {missing[:5]}... were not recorded (recorded {len(lookup)} rows)")
        idx = torch.tensor([lookup[int(p)] for p in want.tolist()], dtype=torch.long)
        return CapturedRows(want, self.queries[:, idx], self.outputs[:, idx], self.scaling)


class AttentionCapture:
    """Context manager recording queries and attention outputs of sampled layers and heads during forwards.

    While active, the model's attention function (``"sdpa"`` or ``"eager"``) is wrapped by a hook of the model's
    attention router (:func:`sur_lab.attention.attention_hook`) in the calling thread only: forwards of other threads,
    and of other models, are neither recorded nor changed. The wrapper receives exactly what the model's attention
    computes with: queries after projection, Q/K normalization and RoPE ``[1, H_Q, L, d_h]``, and the cache's
    keys/values after this forward's update ``[1, H_KV, N, d_h]``; it calls the original function unchanged, so forwards
    are bitwise what they are without the capture. Query rows are at absolute positions ``N − L .. N − 1`` (forwards
    append at the cache end).

    Args:
        lm: the model.
        layers: layer indices to record.
        heads: query-head indices to record (per layer the same heads); ``None`` = all heads.

    Attributes:
        records: after exit, ``{layer: CapturedRows}``.

    Raises:
        ValueError: naming ``layers`` or ``heads`` when out of range, or the attention implementation when it is
            neither ``"sdpa"`` nor ``"eager"`` (before any forward).
    """

    def __init__(self, lm: LoadedModel, layers: Iterable[int], heads: Iterable[int] | None = None):
        spec = lm.spec
        self.lm = lm
        self.layers = sorted({int(x) for x in layers})
        if any(not 0 <= x < spec.num_layers for x in self.layers):
            raise ValueError(f"layers={self.layers} must lie in [0, {spec.num_layers})")
        self.heads = list(range(spec.num_heads)) if heads is None else [int(h) for h in heads]
        if any(not 0 <= h < spec.num_heads for h in self.heads):
            raise ValueError(f"heads={self.heads} must lie in [0, {spec.num_heads})")
        self.impl = native_implementation(lm.model.config) or "eager"
        if self.impl not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation={self.impl!r}: the capture supports 'sdpa' and 'eager'")
        self._parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {x: [] for x in self.layers}
        self._scaling: dict[int, float] = {}
        self.records: dict[int, CapturedRows] = {}
        self._hook: Any = None

    def _wrapper(self) -> Callable:
        head_idx = torch.tensor(self.heads, dtype=torch.long)

        def capture(fn, module, query, key, value, attention_mask, **kwargs):
            out, weights = fn(module, query, key, value, attention_mask, **kwargs)
            layer = int(module.layer_idx)
            if layer in self._parts:
                n_keys, n_q = key.shape[-2], query.shape[-2]
                pos = torch.arange(n_keys - n_q, n_keys, dtype=torch.long)
                idx = head_idx.to(query.device)
                # query [1, H, L, d]; attention output [1, L, H, d] (transposed back by the attention function).
                self._parts[layer].append(
                    (pos, query[0, idx].detach().cpu().clone(), out[0][:, idx].transpose(0, 1).detach().cpu().clone())
                )
                self._scaling[layer] = float(kwargs.get("scaling", module.scaling))
            return out, weights

        return capture

    def __enter__(self) -> "AttentionCapture":
        self._hook = attention_hook(self.lm.model, self._wrapper())
        self._hook.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        hook, self._hook = self._hook, None
        hook.__exit__(*exc)
        for layer, parts in self._parts.items():
            if parts:
                self.records[layer] = CapturedRows(
                    torch.cat([p for p, _, _ in parts]),
                    torch.cat([q for _, q, _ in parts], dim=1),
                    torch.cat([o for _, _, o in parts], dim=1),
                    self._scaling[layer],
                )


@torch.inference_mode()
def refresh_with_queries(
    lm: LoadedModel,
    shift_cache: DynamicCache,
    edit: EditedContext,
    support: Support,
    layers: Iterable[int],
    heads: Iterable[int] | None = None,
) -> tuple[DynamicCache, dict[int, CapturedRows]]:
    """Interval-wise sparse refresh (the ``"sequential"`` executor) while recording queries of refreshed positions.

    Args:
        lm: the model.
        shift_cache: Shift cache (``p + S`` rows); not modified.
        edit: the edit.
        support: suffix positions to refresh.
        layers, heads: what to record (see :class:`AttentionCapture`).

    Returns:
        ``(cache_A, {layer: CapturedRows})`` where the rows are the support's absolute positions ``p + support``.

    Raises:
        ValueError: see :func:`sur_lab.executors.check_support` and :class:`AttentionCapture`.
    """
    check_support(edit, support, shift_cache)
    run = get_executor("sequential")
    with AttentionCapture(lm, layers, heads) as cap:
        cache = run(lm, shift_cache, edit, support)
    return cache, cap.records


@torch.inference_mode()
def replay_with_queries(
    lm: LoadedModel,
    dirty_cache: DynamicCache,
    edit: EditedContext,
    layers: Iterable[int],
    heads: Iterable[int] | None = None,
) -> tuple[DynamicCache, dict[int, CapturedRows]]:
    """Full-suffix Replay (valid prefix of ``dirty_cache`` + one forward of the suffix) while recording queries.

    Returns:
        ``(cache_⋆, {layer: CapturedRows})`` with rows at every suffix position ``p .. p + S − 1``.
    """
    out = slice_rows(dirty_cache, 0, edit.prefix_len)
    with AttentionCapture(lm, layers, heads) as cap:
        forward_tokens(lm, edit.suffix_ids, out, logits="none")
    return out, cap.records


def kv_head_of(head: int, spec) -> int:
    """GQA: the KV head read by query head ``head`` (``head // (H_Q / H_KV)``, as transformers' ``repeat_kv``)."""
    return int(head) // spec.gqa_group


def bound_rows(
    lm: LoadedModel,
    cache_a: DynamicCache,
    captured_a: dict[int, CapturedRows],
    cache_ref: DynamicCache,
    captured_ref: dict[int, CapturedRows],
    positions: torch.Tensor | Sequence[int],
    heads: Sequence[int],
    *,
    prefix_len: int = 0,
    extra: dict[str, Any] | None = None,
) -> "pd.DataFrame":  # noqa: F821 - pandas imported lazily
    """Proposition 14.1 terms for the captured layers, the given heads and absolute query ``positions``.

    Args:
        lm: the model (for the GQA head mapping).
        cache_a, captured_a: the mixed cache and its captured queries (:func:`refresh_with_queries`).
        cache_ref, captured_ref: the Replay cache and its captured queries (:func:`replay_with_queries`).
        positions: ``[n]`` absolute rows (refreshed positions) to evaluate.
        heads: query heads, in the order they were captured (the capture's ``heads``).
        prefix_len: p, to report suffix-local positions.
        extra: constant columns to add (budget, method ...).

    Returns:
        DataFrame with one row per (layer, head, position): ``layer, head, kv_head, position, suffix_pos, num_keys``,
        every :attr:`BoundTerms.SCALARS` field, ``capture_err`` (max-abs difference between the float64 recomputed
        ``o_i^A`` and the attention output the model produced), ``holds`` (``lhs ≤ bound25``), ``holds_26``
        (``logit_dev ≤ logit_bound26``), ``allowance`` (:func:`bound_rounding_allowance`) and ``slack``
        (``bound25 / lhs``).
    """
    pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    frames = []
    for layer in sorted(captured_a):
        rows_a = captured_a[layer].rows(pos)
        rows_ref = captured_ref[layer].rows(pos)
        ka, va = layer_kv(cache_a, layer)
        kr, vr = layer_kv(cache_ref, layer)
        kv = torch.tensor([kv_head_of(h, lm.spec) for h in heads], dtype=torch.long)
        terms = mixed_cache_bound(
            rows_a.queries, ka[0, kv].cpu(), va[0, kv].cpu(), rows_ref.queries, kr[0, kv].cpu(), vr[0, kv].cpu(),
            pos, scaling=rows_a.scaling,
        )
        err = (terms.o_a - rows_a.outputs.double()).abs().amax(-1)  # [H_s, n]
        allow = bound_rounding_allowance(terms, pos + 1)
        data = {name: getattr(terms, name).reshape(-1).numpy() for name in BoundTerms.SCALARS}
        n_h, n = len(heads), pos.numel()
        df = pd.DataFrame({
            "layer": layer,
            "head": np.repeat(np.asarray(heads), n),
            "kv_head": np.repeat(kv.numpy(), n),
            "position": np.tile(pos.numpy(), n_h),
            "suffix_pos": np.tile(pos.numpy() - prefix_len, n_h),
            "num_keys": np.tile(pos.numpy() + 1, n_h),
            **data,
            "capture_err": err.reshape(-1).numpy(),
            "allowance": allow.reshape(-1).numpy(),
        })
        frames.append(df)
    out = pd.concat(frames, ignore_index=True)
    out["holds"] = out["lhs"] <= out["bound25"]
    out["holds_26"] = out["logit_dev"] <= out["logit_bound26"]
    with np.errstate(divide="ignore", invalid="ignore"):
        out["slack"] = out["bound25"] / out["lhs"]
    for key, value in (extra or {}).items():
        out.insert(0, key, value)
    return out


def evenly_spaced_layers(num_layers: int, k: int) -> list[int]:
    """``k`` layer indices spread evenly over ``[0, num_layers)``, first and last included (all when k ≥ L).

    Raises:
        ValueError: naming ``k`` when it is below 1.
    """
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    if k >= num_layers:
        return list(range(num_layers))
    return sorted({int(round(x)) for x in np.linspace(0, num_layers - 1, k)})


def sample_rows(positions: np.ndarray, max_rows: int, seed: int) -> np.ndarray:
    """At most ``max_rows`` of ``positions`` chosen uniformly without replacement (seeded), sorted."""
    positions = np.asarray(positions, dtype=np.int64)
    if max_rows <= 0 or len(positions) <= max_rows:
        return np.sort(positions)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(positions, size=max_rows, replace=False))


def bound_study(
    lm: LoadedModel,
    prepared,
    supports: dict[Any, Support],
    *,
    layers: Sequence[int],
    heads: Sequence[int],
    max_rows: int = 64,
    seed: int = 0,
    replay_capture: tuple[DynamicCache, dict[int, CapturedRows]] | None = None,
    progress: bool = True,
) -> "pd.DataFrame":  # noqa: F821
    """Proposition 14.1 on a real model: every term for sampled refreshed positions, layers and heads.

    Replay (⋆) runs once with the capture (unless ``replay_capture`` is given); each support runs the interval-wise
    executor with the capture (A).

    Args:
        lm: the model.
        prepared: :class:`sur_lab.repair.PreparedEdit` (Dirty and Shift caches; not modified).
        supports: ``{label: Support}`` (label: a budget in % or any key), each with ``0 < B < S``.
        layers: layers to sample; heads: query heads to sample (the same in every layer).
        max_rows: refreshed positions evaluated per support (sampled with ``seed``; all when fewer).
        seed: row sampling seed.
        replay_capture: ``(cache_⋆, captured)`` from :func:`replay_with_queries` with the same layers and heads.
        progress: show a tqdm bar.

    Returns:
        DataFrame of :func:`bound_rows` with columns ``label, B, R`` prepended.

    Raises:
        ValueError: naming ``supports`` when one is empty or full (B = 0 or B = S leave nothing to bound), or
            ``replay_capture`` when it lacks a sampled layer.
    """
    edit = prepared.edit
    for label, sup in supports.items():
        if not 0 < sup.size < edit.suffix_len:
            raise ValueError(f"supports[{label!r}] has B={sup.size}; need 0 < B < S={edit.suffix_len}")
    if replay_capture is None:
        replay_capture = replay_with_queries(lm, prepared.dirty_cache, edit, layers, heads)
    cache_ref, q_ref = replay_capture
    missing = sorted(set(layers) - set(q_ref))
    if missing:
        raise ValueError(f"replay_capture lacks layers {missing}")
    frames = []
    for label, sup in tqdm(supports.items(), desc="supports", disable=not progress):
        cache_a, q_a = refresh_with_queries(lm, prepared.shift_cache, edit, sup, layers, heads)
        rows = sample_rows(sup.absolute(edit.prefix_len), max_rows, seed)
        frames.append(
            bound_rows(
                lm, cache_a, q_a, cache_ref, q_ref, rows, heads, prefix_len=edit.prefix_len,
                extra={"R": sup.num_intervals, "B": sup.size, "label": label},
            )
        )
    return pd.concat(frames, ignore_index=True)


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



# ---------------------------------------------------------------------------------------------------------------------
# Building the case


def theory_edit(
    tokenizer,
    source: str = "hotpotqa",
    *,
    example_index: int = 0,
    num_passages: int = 10,
    delete_at: int = 1,
    deletion_width: int = 1,
    haystack_passages: int = 0,
    seed: int = 0,
) -> tuple[EditedContext, Any]:
    """A real-context deletion edit for the theory notebook.

    The context is the example's supporting and distractor passages shuffled with ``seed`` (``source`` a development
    dataset key or file), or, for ``source="haystack"``, the HotpotQA example's supporting passages mixed with
    ``haystack_passages`` filler paragraphs from :func:`sur_lab.data.qa.load_corpus` chosen with ``seed``. The first
    ``num_passages`` of the shuffled list are kept and ``deletion_width`` consecutive passages starting at index
    ``delete_at`` are deleted (never the last passage, which would leave no suffix).

    Returns:
        ``(edit, example)``.

    Raises:
        TypeError: naming ``example_index``, ``num_passages``, ``haystack_passages``, ``delete_at``,
            ``deletion_width`` or ``seed`` when not an integer.
        ValueError: before any file is read, naming ``example_index``, ``haystack_passages``, ``delete_at`` or
            ``seed`` when negative, ``deletion_width`` when < 1, ``num_passages`` when < 2; then naming ``delete_at`` /
            ``deletion_width`` / ``num_passages`` when the deletion does not fit, ``example_index`` when past the
            last example (:func:`sur_lab.data.qa.load_example`), or ``source`` when it names a held-out
            split.
    """
    as_count(example_index, "example_index", minimum=0)
    as_count(num_passages, "num_passages", minimum=2)
    as_count(haystack_passages, "haystack_passages", minimum=0)
    as_count(delete_at, "delete_at", minimum=0)
    as_count(deletion_width, "deletion_width", minimum=1)
    as_count(seed, "seed", minimum=0)
    if is_held_out(source):  # by the data README's file names (and pinned checksums), not any path with "test"
        raise ValueError(f"source={source!r}: held-out test files are for final evaluation only")
    rng = np.random.default_rng(seed)
    if source == "haystack":
        example = load_example("hotpotqa", example_index)
        corpus = load_corpus()
        filler = [corpus[i] for i in rng.choice(len(corpus), size=haystack_passages, replace=False)]
        passages = list(example.supporting) + filler
    else:
        example = load_example(source, example_index)
        passages = list(example.supporting) + list(example.distractors)
    order = rng.permutation(len(passages))
    passages = [passages[i] for i in order][:num_passages]
    if delete_at + deletion_width > len(passages) or len(passages) < 2:
        raise ValueError(
            f"delete_at={delete_at}, deletion_width={deletion_width}: only {len(passages)} passages (num_passages)"
        )
    if delete_at + deletion_width == len(passages):
        raise ValueError(f"delete_at={delete_at} + deletion_width={deletion_width} deletes the last passage: no suffix")
    documents, spans = format_passages(passages)
    span = (spans[delete_at][0], spans[delete_at + deletion_width - 1][1])
    return chat_edit(tokenizer, documents, example.question, span), example

__all__ = [
    "AttentionCapture",
    "BoundTerms",
    "CapturedRows",
    "bound_rounding_allowance",
    "bound_rows",
    "bound_study",
    "bound_summary",
    "causal_attention_rows",
    "eq28_table",
    "evenly_spaced_layers",
    "kv_head_of",
    "mixed_cache_bound",
    "refresh_with_queries",
    "replay_with_queries",
    "sample_rows",
    "theory_edit",
]
