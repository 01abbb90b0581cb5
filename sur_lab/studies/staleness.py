"""Where stale states live in a real cache: per-layer, per-position K/V deviation from full-suffix Replay.

After a deletion, Shift keeps every suffix K/V computed while the deleted span was visible (re-rotating keys only,
Eq. 2). Its deviation from Replay, measured per layer and per suffix position, shows where the staleness sits: zero at
layer 0 (token-local K/V, exact after re-rotation up to rounding), growing with depth, and decaying with distance
from the deletion. Budgeted repair removes part of it; the residual deviation of a repaired cache from Replay, as the
budget grows, compares how allocators spend it (SUR against "Dense tokens", the top-B tokens by SUR's own score).

Source: appendix 14 (stale causal predecessors), section 3 and appendix 7.1 (Shift, sparse refresh), Table 6 (Dense
tokens control).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from tqdm.auto import tqdm
from transformers import DynamicCache

from sur_lab.allocators import AllocationRequest, allocate, get_allocator, top_b
from sur_lab.allocators.sur import sur_token_scores
from sur_lab.analysis.endpoints import row_deviation
from sur_lab.analysis.plotting import token_pieces, token_view
from sur_lab.budget import Support, allowance
from sur_lab.cache_ops import cache_length, num_layers, to_tensors
from sur_lab.edits import EditedContext
from sur_lab.executors import get_executor, replay, reprefill
from sur_lab.models import LoadedModel

#: The paper's name of the dense-token control (top-B tokens by SUR's token score, Table 6).
DENSE_TOKENS = "Dense tokens"


@dataclass(frozen=True)
class KVDeviation:
    """Per-layer, per-suffix-position deviation of a cache from a reference cache (both ``p + S`` rows).

    Attributes:
        keys: float64 ``[L, S]``, ``‖K_l[:, p+i] − K_l^ref[:, p+i]‖₂`` over all KV heads and the head dimension.
        values: float64 ``[L, S]``, the same for values.
        ref_keys: float64 ``[L, S]``, ``‖K_l^ref[:, p+i]‖₂`` (scale for relative deviations).
        ref_values: float64 ``[L, S]``, ``‖V_l^ref[:, p+i]‖₂``.
    """

    keys: np.ndarray
    values: np.ndarray
    ref_keys: np.ndarray
    ref_values: np.ndarray

    @property
    def relative_keys(self) -> np.ndarray:
        """``keys / ref_keys``, float64 ``[L, S]``."""
        return self.keys / self.ref_keys

    @property
    def relative_values(self) -> np.ndarray:
        """``values / ref_values``, float64 ``[L, S]``."""
        return self.values / self.ref_values

    def total(self, mask: np.ndarray | None = None) -> dict[str, float]:
        """Relative Frobenius deviation over layers and the suffix positions in ``mask`` (``[S]`` bool; all if None).

        Returns:
            ``{"keys": ‖ΔK‖_F / ‖K^ref‖_F, "values": ‖ΔV‖_F / ‖V^ref‖_F}`` (NaN for an empty mask).
        """
        sel = slice(None) if mask is None else np.asarray(mask, dtype=bool)
        out = {}
        for name, dev, ref in (("keys", self.keys, self.ref_keys), ("values", self.values, self.ref_values)):
            d, r = dev[:, sel], ref[:, sel]
            out[name] = float(np.sqrt((d**2).sum()) / np.sqrt((r**2).sum())) if d.size else float("nan")
        return out


def kv_deviation(cache: DynamicCache, reference: DynamicCache, edit: EditedContext) -> KVDeviation:
    """Deviation of ``cache`` from ``reference`` at every layer and suffix position (neither cache is modified).

    Args:
        cache: a ``p + S``-row cache (Shift or a repaired cache).
        reference: the Replay cache of the same edit (``p + S`` rows).
        edit: the edit.

    Returns:
        :class:`KVDeviation` with ``[L, S]`` arrays (computed in float64).

    Raises:
        ValueError: naming ``cache`` or ``reference`` when its length or layer count does not match the edit.
    """
    n = edit.edited_len
    for name, c in (("cache", cache), ("reference", reference)):
        if cache_length(c) != n:
            raise ValueError(f"{name} has {cache_length(c)} rows; the edit's edited context has {n}")
    if num_layers(cache) != num_layers(reference):
        raise ValueError(f"cache has {num_layers(cache)} layers; reference has {num_layers(reference)}")
    rows = edit.suffix_slice
    parts: dict[str, list[np.ndarray]] = {"k": [], "v": [], "rk": [], "rv": []}
    for (k, v), (kr, vr) in zip(to_tensors(cache), to_tensors(reference)):
        k, v, kr, vr = (t[0, :, rows].double() for t in (k, v, kr, vr))  # [H_kv, S, d_h]
        parts["k"].append((k - kr).pow(2).sum(dim=(0, 2)).sqrt().cpu().numpy())
        parts["v"].append((v - vr).pow(2).sum(dim=(0, 2)).sqrt().cpu().numpy())
        parts["rk"].append(kr.pow(2).sum(dim=(0, 2)).sqrt().cpu().numpy())
        parts["rv"].append(vr.pow(2).sum(dim=(0, 2)).sqrt().cpu().numpy())
    return KVDeviation(*(np.stack(parts[key]) for key in ("k", "v", "rk", "rv")))


def distance_profile(dev: KVDeviation, *, num_bins: int = 12) -> "pd.DataFrame":  # noqa: F821
    """Relative K/V deviation against distance from the deletion, per layer, in log-spaced distance bins.

    Suffix position i (zero-based) sits ``i + 1`` tokens after the cut.

    Returns:
        DataFrame with columns ``layer, distance_lo, distance_hi, distance`` (geometric bin centre, tokens),
        ``keys, values`` (median relative deviation in the bin) and ``n`` (positions in the bin).

    Raises:
        ValueError: naming ``num_bins`` when below 1.
    """
    if num_bins < 1:
        raise ValueError(f"num_bins={num_bins} must be >= 1")
    L, S = dev.keys.shape
    distance = np.arange(1, S + 1)
    edges = np.unique(np.round(np.geomspace(1, S + 1, num_bins + 1)).astype(np.int64))
    rel_k, rel_v = dev.relative_keys, dev.relative_values
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (distance >= lo) & (distance < hi)
        if not sel.any():
            continue
        for layer in range(L):
            rows.append({
                "layer": layer, "distance_lo": int(lo), "distance_hi": int(hi - 1),
                "distance": float(np.sqrt(lo * (hi - 1))),
                "keys": float(np.median(rel_k[layer, sel])), "values": float(np.median(rel_v[layer, sel])),
                "n": int(sel.sum()),
            })
    return pd.DataFrame(rows)


def dense_tokens_registered() -> bool:
    """Whether the ``"Dense tokens"`` allocator is registered (its module ``sur_lab.allocators.controls`` is imported
    here when it exists, so the control is picked up as soon as it lands)."""
    try:
        importlib.import_module("sur_lab.allocators.controls")
    except ModuleNotFoundError as err:
        if err.name != "sur_lab.allocators.controls":
            raise
    try:
        get_allocator(DENSE_TOKENS)
    except ValueError:
        return False
    return True


def method_support(lm: LoadedModel, prepared, method: str, budget_pct: float, *, seed: int = 0) -> Support:
    """The support allocator ``method`` chooses at ``budget_pct`` for ``prepared.edit``.

    ``"Dense tokens"`` uses the registered allocator when there is one; otherwise the same rule is applied directly:
    ``top_b(sur_token_scores(request), B)`` (the top-B suffix tokens by SUR's token score, earlier first among ties).

    Raises:
        ValueError: for an unknown method or a budget outside [0, 100].
    """
    edit = prepared.edit
    request = AllocationRequest(
        lm, edit, budget_pct, shift_cache=prepared.shift_cache, units=prepared.get_units(), seed=seed,
    )
    if method == DENSE_TOKENS and not dense_tokens_registered():
        return Support(top_b(sur_token_scores(request), request.allowance), edit.suffix_len)
    return allocate(method, request).support


def pick_executor(name: str = "auto") -> str:
    """``"auto"``: the packed executor when registered (``"packed-sdpa"``), else ``"sequential"``; other names are
    checked and returned."""
    if name != "auto":
        get_executor(name)
        return name
    try:
        get_executor("packed-sdpa")
        return "packed-sdpa"
    except ValueError:
        return "sequential"


def residual_by_budget(
    lm: LoadedModel,
    prepared,
    reference: DynamicCache,
    budgets: Sequence[float],
    methods: Sequence[str] = ("SUR", DENSE_TOKENS),
    *,
    executor: str = "auto",
    seed: int = 0,
    progress: bool = True,
) -> "pd.DataFrame":  # noqa: F821
    """Residual K/V deviation from Replay of repaired caches, per method and budget (Shift is budget 0).

    Args:
        lm, prepared: the model and prepared edit (not modified).
        reference: the Replay cache (``p + S`` rows).
        budgets: budgets b in % (B = 0 is Shift, B = S is Replay).
        methods: allocator names (``"Dense tokens"`` falls back to the direct rule, see :func:`method_support`).
        executor: executor name or ``"auto"`` (:func:`pick_executor`).
        seed: allocator seed.
        progress: show a tqdm bar.

    Returns:
        DataFrame, one row per (method, budget): ``method, budget_pct, B, R, executor, keys, values`` (relative
        Frobenius deviation over all layers and suffix positions), ``keys_of_shift, values_of_shift`` (the same as a
        fraction of Shift's), ``keys_refreshed, values_refreshed, keys_unrefreshed, values_unrefreshed`` (restricted
        to refreshed / unrefreshed positions).
    """
    edit = prepared.edit
    S = edit.suffix_len
    ex = pick_executor(executor)
    run = get_executor(ex)
    shift_total = kv_deviation(prepared.shift_cache, reference, edit).total()
    rows = []
    for method in methods:
        for b in tqdm(budgets, desc=method, disable=not progress):
            B = allowance(S, b)
            if B == 0:
                sup, cache = Support(np.zeros(0, dtype=np.int64), S), prepared.shift_cache
            elif B == S:
                sup, cache = Support.full(S), replay(lm, prepared.dirty_cache, edit)
            else:
                sup = method_support(lm, prepared, method, b, seed=seed)
                cache = run(lm, prepared.shift_cache, edit, sup)
            dev = kv_deviation(cache, reference, edit)
            mask = sup.mask()
            tot, on, off = dev.total(), dev.total(mask), dev.total(~mask)
            rows.append({
                "method": method, "budget_pct": float(b), "B": B, "R": sup.num_intervals, "executor": ex,
                "keys": tot["keys"], "values": tot["values"],
                "keys_of_shift": tot["keys"] / shift_total["keys"],
                "values_of_shift": tot["values"] / shift_total["values"],
                "keys_refreshed": on["keys"], "values_refreshed": on["values"],
                "keys_unrefreshed": off["keys"], "values_unrefreshed": off["values"],
            })
    return pd.DataFrame(rows)


def repair_token_view(lm: LoadedModel, prepared, repairs, *, executor: str = "sequential", seed: int = 0,
                      title: str = ""):
    """The token view (:func:`sur_lab.analysis.plotting.token_view`) of one prepared edit under several repairs.

    Each repair's support is chosen as in :func:`method_support` (``"Shift"`` refreshes nothing) and recomputed by
    ``executor``; each row's K/V deviation from Re-prefill's cache
    (:func:`sur_lab.analysis.endpoints.row_deviation`) is the second shading.
    Relevance is SUR's token score (Eq. 7) and the units are the edit's semantic units, whatever the repairs.

    Args:
        lm, prepared: the model and the prepared edit (:func:`sur_lab.repair.prepare`; not modified).
        repairs: ``(method, budget_pct)`` pairs, e.g. ``[("Shift", None), ("SUR", 5), ("Dense tokens", 5)]``.
        executor: executor of the sparse refreshes.
        seed: allocator seed.
        title: the view's heading.

    Returns:
        The :class:`~sur_lab.analysis.plotting.TokenView`.

    Raises:
        ValueError: for an unknown method or executor, or a budget outside [0, 100].
    """
    edit = prepared.edit
    S = edit.suffix_len
    reference = reprefill(lm, edit)
    run = get_executor(executor)
    supports, deviation = {}, {}
    for method, budget in repairs:
        if method == "Shift":
            support, cache = Support(np.zeros(0, dtype=np.int64), S), prepared.shift_cache
        else:
            support = method_support(lm, prepared, method, budget, seed=seed)
            cache = run(lm, prepared.shift_cache, edit, support) if support.size else prepared.shift_cache
        supports[(method, budget)] = support
        deviation[(method, budget)] = row_deviation(cache, reference)
    request = AllocationRequest(lm, edit, 0.0, shift_cache=prepared.shift_cache, units=prepared.get_units(), seed=seed)
    query = lm.tokenizer.decode(edit.query_ids.tolist()) if lm.tokenizer is not None else None
    return token_view(token_pieces(lm.tokenizer, edit.original_ids), prefix_len=edit.prefix_len,
                      deleted_len=edit.deleted_len, refreshed=supports, relevance=sur_token_scores(request),
                      units=prepared.get_units(), deviation=deviation, query=query, title=title)


__all__ = [
    "DENSE_TOKENS",
    "KVDeviation",
    "dense_tokens_registered",
    "distance_profile",
    "kv_deviation",
    "method_support",
    "pick_executor",
    "repair_token_view",
    "residual_by_budget",
]
