"""Numerical validation of packed execution and of the indexed-attention kernel (appendix 13.5), the logic of
``notebooks/05_kernel_numerical_validation.ipynb``.

Three probes:

1. Packed vs sequential on a model: the input Shift cache and every unselected K/V row bit-identical, selected K/V
   per layer (max |error|, RMS, relative L2), query logits (relative L2, max, RMS) and next-token argmax agreement.
2. The Triton kernel against the explicit FP64 causal oracle over causal gaps, tails, GQA, strided inputs and changed
   plan metadata: fixed tolerances BF16 atol 0.002 / rtol 0.02, FP16 atol 0.00025 / rtol 0.003 (appendix 13.5), and
   for every dtype the flash-attention-style budget "within twice the same-dtype SDPA reference's error plus one
   output ulp".
3. The FP32-promotion control: identical BF16 weights and Shift cache promoted to FP32 (TF32 off) give a reference;
   the custom path's selected-K/V and query-logit max/RMS errors must stay within twice the native packed-SDPA
   errors (the paper's fixed engineering budget; a diagnostic, not an accuracy guarantee).

Errors are computed in float64. These are numerical probes, not task-quality results.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from transformers import DynamicCache

from sur_lab.budget import Support
from sur_lab.cache_ops import caches_equal, clone_cache, from_tensors, to_tensors
from sur_lab.edits import EditedContext
from sur_lab.executors import get_executor
from sur_lab.executors.kernels import (
    build_indexed_attention_plan,
    causal_attention_oracle,
    indexed_attention,
    kernel_error_floor,
    packed_sdpa_reference,
    uses_triton,
)
from sur_lab.forward import forward_tokens
from sur_lab.models import LoadedModel, wrap_model

#: Fixed kernel tolerances against the FP64 oracle, (atol, rtol) (appendix 13.5).
FIXED_TOLERANCES = {torch.bfloat16: (0.002, 0.02), torch.float16: (0.00025, 0.003)}
#: The FP32-promotion control's budget: custom error <= this factor x native packed-SDPA error (appendix 13.5).
PROMOTION_BUDGET = 2.0

__all__ = [
    "FIXED_TOLERANCES",
    "PROMOTION_BUDGET",
    "KernelCase",
    "fp32_promotion_control",
    "kernel_cases",
    "kernel_oracle_errors",
    "layer_errors",
    "logit_errors",
    "packed_vs_sequential",
    "promote_cache",
    "promoted_model",
    "query_logits",
    "truncated_model",
]


# ------------------------------------------------------------------------------------------- packed vs sequential


def query_logits(lm: LoadedModel, cache: DynamicCache, edit: EditedContext) -> torch.Tensor:
    """Logits ``[Q, V]`` (float32) of the edit's query tokens forwarded on a clone of ``cache`` (not modified)."""
    return forward_tokens(lm, edit.query_ids, clone_cache(cache), logits="all")


def _stats(a: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = a.double() - ref.double()
    norm = ref.double().norm().item()
    return {
        "max_abs": diff.abs().max().item() if diff.numel() else 0.0,
        "rms": diff.pow(2).mean().sqrt().item() if diff.numel() else 0.0,
        "rel_l2": diff.norm().item() / norm if norm > 0 else float(diff.norm().item() > 0) * math.inf,
    }


def layer_errors(cache: DynamicCache, reference: DynamicCache, absolute: np.ndarray) -> pd.DataFrame:
    """Selected-row K and V errors per layer against a reference cache.

    Args:
        cache, reference: caches of the same shape.
        absolute: ``[B]`` absolute rows to compare.

    Returns:
        One row per (layer, tensor in {"K", "V"}): ``max_abs``, ``rms``, ``rel_l2`` (``||X - X_ref|| / ||X_ref||``
        over heads, rows and head dims), all float64.
    """
    rows = []
    idx = torch.as_tensor(np.asarray(absolute), dtype=torch.long)
    for layer, ((k, v), (kr, vr)) in enumerate(zip(to_tensors(cache), to_tensors(reference))):
        i = idx.to(k.device)
        for name, a, b in (("K", k, kr), ("V", v, vr)):
            rows.append({"layer": layer, "tensor": name, **_stats(a[:, :, i], b[:, :, i])})
    return pd.DataFrame(rows)


def logit_errors(logits: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Query-logit errors ``[Q, V]`` vs a reference: ``max_abs``, ``rms``, ``rel_l2``, ``argmax_last_equal`` (the
    next-token argmax after the query) and ``argmax_agreement`` (fraction of query positions with equal argmax)."""
    out = _stats(logits, reference)
    same = logits.argmax(-1) == reference.argmax(-1)
    out["argmax_last_equal"] = bool(same[-1])
    out["argmax_agreement"] = float(same.double().mean())
    return out


def _rows_identical_except(cache: DynamicCache, shift: DynamicCache, absolute: np.ndarray) -> bool:
    for (k, v), (ks, vs) in zip(to_tensors(cache), to_tensors(shift)):
        keep = torch.ones(k.shape[2], dtype=torch.bool, device=k.device)
        keep[torch.as_tensor(np.asarray(absolute), dtype=torch.long, device=k.device)] = False
        if not (torch.equal(k[:, :, keep], ks[:, :, keep]) and torch.equal(v[:, :, keep], vs[:, :, keep])):
            return False
    return True


def packed_vs_sequential(
    lm: LoadedModel,
    edit: EditedContext,
    shift: DynamicCache,
    support: Support,
    executors: Sequence[str] = ("packed-sdpa", "packed-flex", "packed-triton"),
    *,
    reference: str = "sequential",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Compare executors with the reference executor on one support (appendix 13.5, first paragraph).

    Args:
        lm: the model.
        edit: the edit; its query tokens give the query logits.
        shift: Shift cache (checked bitwise unchanged after every executor).
        support: suffix-local support.
        executors: registered executor names to validate.
        reference: the reference executor (interval-wise ``"sequential"``).

    Returns:
        ``(summary, layers)``: summary has one row per executor with ``input_unchanged``, ``unselected_identical``,
        ``kv_max_abs``, ``kv_max_rel_l2`` (over layers), the :func:`logit_errors` fields prefixed ``logits_``;
        layers has the :func:`layer_errors` rows with an ``executor`` column.
    """
    absolute = support.absolute(edit.prefix_len)
    before = clone_cache(shift)
    ref_cache = get_executor(reference)(lm, shift, edit, support)
    ref_logits = query_logits(lm, ref_cache, edit)
    summary, layers = [], []
    for name in executors:
        out = get_executor(name)(lm, shift, edit, support)
        per_layer = layer_errors(out, ref_cache, absolute).assign(executor=name)
        logits = logit_errors(query_logits(lm, out, edit), ref_logits)
        summary.append(
            {
                "executor": name,
                "input_unchanged": caches_equal(shift, before),
                "unselected_identical": _rows_identical_except(out, shift, absolute),
                "kv_max_abs": per_layer["max_abs"].max(),
                "kv_max_rel_l2": per_layer["rel_l2"].max(),
                **{f"logits_{k}": v for k, v in logits.items()},
            }
        )
        layers.append(per_layer)
        del out
    return pd.DataFrame(summary), pd.concat(layers, ignore_index=True)


# ------------------------------------------------------------------------------------------ kernel vs FP64 oracle


@dataclass(frozen=True)
class KernelCase:
    """One indexed-attention shape for the oracle comparison.

    Attributes:
        name: label.
        num_heads: Hq.
        num_kv_heads: Hkv (GQA group Hq / Hkv).
        cache_len: N, K/V rows.
        head_dim: d (64 or 128 for the kernel).
        positions: sorted unique absolute positions U.
        strided: q/k/v passed as non-contiguous views (a transposed allocation).
        changed_metadata: the kernel first runs with another plan (other B and positions), then with this one.
    """

    name: str
    num_heads: int
    num_kv_heads: int
    cache_len: int
    head_dim: int
    positions: tuple[int, ...]
    strided: bool = False
    changed_metadata: bool = False


def _spans(*spans: tuple[int, int]) -> tuple[int, ...]:
    return tuple(p for lo, hi in spans for p in range(lo, hi))


def kernel_cases(max_len: int = 1023) -> list[KernelCase]:
    """The oracle cases: causal gaps (R = 4 and random), tails ending at N - 1, a single position, all positions,
    MHA / GQA 3 / GQA 4 / MQA, head dims 64 and 128, awkward lengths (113, 239, 799, ``max_len``), strided inputs and
    changed plan metadata. ``max_len`` caps every N (the Triton interpreter is slow: keep it near 1K on a CPU)."""
    n = max(int(max_len), 128)
    cap = lambda length: min(length, n)  # noqa: E731
    rng = np.random.default_rng(0)
    gaps = tuple(int(x) for x in np.sort(rng.choice(n, size=64, replace=False)))
    r4 = _spans((n // 8, n // 8 + 16), (3 * n // 8, 3 * n // 8 + 16), (5 * n // 8, 5 * n // 8 + 16), (n - 24, n - 8))
    tail = cap(799)
    return [
        KernelCase(f"gaps R=4, GQA 3, d=64, N={n}", 6, 2, n, 64, r4),
        KernelCase(f"random gaps B=64, GQA 4, d=128, N={n}", 4, 1, n, 128, gaps),
        KernelCase(f"tail, MHA, d=64, N={tail}", 2, 2, tail, 64, _spans((tail - 37, tail))),
        KernelCase("tail, MQA, d=128, N=239", 4, 1, 239, 128, _spans((200, 239))),
        KernelCase("single position, GQA 3, d=64, N=113", 3, 1, 113, 64, (57,)),
        KernelCase("all positions, GQA 3, d=64, N=113", 3, 1, 113, 64, tuple(range(113))),
        KernelCase(f"strided q/k/v, GQA 3, d=64, N={tail}", 6, 2, tail, 64,
                   _spans((10, 30), (tail // 2, tail // 2 + 40)), strided=True),
        KernelCase("changed metadata, GQA 4, d=128, N=239", 4, 1, 239, 128, _spans((0, 17), (100, 133)),
                   changed_metadata=True),
    ]


def _case_tensors(case: KernelCase, dtype: torch.dtype, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    b = len(case.positions)

    def randn(heads: int, rows: int) -> torch.Tensor:
        if case.strided:
            # Allocate [1, rows, heads, d] and view it as [1, heads, rows, d]: the layout of transformers' projections.
            x = torch.randn((1, rows, heads, case.head_dim), generator=gen).transpose(1, 2)
        else:
            x = torch.randn((1, heads, rows, case.head_dim), generator=gen)
        return x.to(device=device, dtype=dtype)

    q = randn(case.num_heads, b)
    return q, randn(case.num_kv_heads, case.cache_len), randn(case.num_kv_heads, case.cache_len)


def kernel_oracle_errors(
    cases: Sequence[KernelCase] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16),
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> pd.DataFrame:
    """Run ``sur_lab.executors.kernels.indexed_attention`` on every case and dtype and compare with the FP64 oracle.

    Returns:
        One row per (case, dtype): ``backend`` ("triton" or "fallback"), ``max_abs`` (kernel vs oracle),
        ``sdpa_max_abs`` (same-dtype SDPA reference vs oracle), ``fixed_ratio`` = max over elements of
        ``|err| / (atol + rtol |oracle|)`` (NaN for FP32, which has no fixed tolerance), ``sdpa_ratio`` =
        ``max_abs / (2 sdpa_max_abs + floor)`` with floor :func:`sur_lab.executors.kernels.kernel_error_floor` (one output ulp
        plus the FP32 exp2-softmax budget), and ``passed`` (both ratios <= 1).
    """
    device = torch.device(device)
    rows = []
    for i, case in enumerate(cases if cases is not None else kernel_cases()):
        for dtype in dtypes:
            q, k, v = _case_tensors(case, dtype, device, seed + i)
            positions = torch.tensor(case.positions, dtype=torch.long, device=device)
            if case.changed_metadata:
                other = build_indexed_attention_plan(torch.arange(case.cache_len - 5, case.cache_len, device=device))
                q_other = q[:, :, :5].clone()
                indexed_attention(q_other, k, v, other)  # compiles and runs with other metadata first
            out = indexed_attention(q, k, v, build_indexed_attention_plan(positions))
            oracle = causal_attention_oracle(q, k, v, positions)
            sdpa = packed_sdpa_reference(q, k, v, positions)
            err = (out.double() - oracle).abs()
            sdpa_err = (sdpa.double() - oracle).abs().max().item()
            floor = kernel_error_floor(q, k, v, positions, oracle=oracle)
            fixed = FIXED_TOLERANCES.get(dtype)
            fixed_ratio = (err / (fixed[0] + fixed[1] * oracle.abs())).max().item() if fixed else float("nan")
            sdpa_ratio = err.max().item() / (2 * sdpa_err + floor)
            rows.append(
                {
                    "case": case.name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "backend": "triton" if uses_triton(device) else "fallback",
                    "rows": len(case.positions),
                    "cache_len": case.cache_len,
                    "max_abs": err.max().item(),
                    "sdpa_max_abs": sdpa_err,
                    "fixed_ratio": fixed_ratio,
                    "sdpa_ratio": sdpa_ratio,
                    "passed": bool(sdpa_ratio <= 1 and (not fixed or fixed_ratio <= 1)),
                }
            )
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------ FP32-promotion control


def truncated_model(lm: LoadedModel, num_layers: int, dtype: torch.dtype | None = None) -> LoadedModel:
    """A copy of ``lm`` keeping its first ``num_layers`` decoder layers (all when 0), optionally cast to ``dtype``.

    Used to keep the FP32-promotion control affordable where the Triton kernel only runs interpreted (a CPU): the
    kept layers' weights are the model's own. ``lm`` is not modified.

    Raises:
        ValueError: naming ``num_layers`` when outside ``[0, lm.spec.num_layers]``.
    """
    if not 0 <= num_layers <= lm.spec.num_layers:
        raise ValueError(f"num_layers={num_layers} must be in [0, {lm.spec.num_layers}]")
    model = copy.deepcopy(lm.model)
    if num_layers:
        model.model.layers = model.model.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:num_layers]
    if dtype is not None:
        model = model.to(dtype)
    return wrap_model(model, lm.tokenizer, lm.spec.name)


def promoted_model(lm: LoadedModel, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A copy of ``lm`` with every parameter and buffer cast to ``dtype`` (``lm`` is not modified)."""
    model = copy.deepcopy(lm.model).to(dtype)
    return wrap_model(model, lm.tokenizer, lm.spec.name)


def promote_cache(cache: DynamicCache, dtype: torch.dtype = torch.float32) -> DynamicCache:
    """A copy of ``cache`` with keys and values cast to ``dtype``."""
    return from_tensors([(k.to(dtype).clone(), v.to(dtype).clone()) for k, v in to_tensors(cache)])


def fp32_promotion_control(
    lm: LoadedModel,
    edit: EditedContext,
    shift: DynamicCache,
    support: Support,
    *,
    custom: str = "packed-triton",
    native: str = "packed-sdpa",
    reference: str = "sequential",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The FP32-promotion control of appendix 13.5 on one support.

    The low-precision model ``lm`` (BF16 in the paper) and its Shift cache are promoted to FP32 (with TF32 disabled
    on CUDA) and the ``reference`` executor gives reference K/V and query logits. The ``native`` and ``custom``
    executors run in the original precision; for every layer, K and V (selected rows) and the query logits, the
    custom max and RMS errors are divided by the native ones.

    Returns:
        ``(ratios, summary)``: ratios has one row per (quantity, statistic) with ``native``, ``custom``, ``ratio`` and
        ``within_budget`` (ratio <= :data:`PROMOTION_BUDGET`; a zero native error counts as within budget only if the
        custom error is zero too); summary has ``max_ratio``, ``worst`` (its quantity), ``passed``.
    """
    absolute = support.absolute(edit.prefix_len)
    lm32 = promoted_model(lm, torch.float32)
    shift32 = promote_cache(shift, torch.float32)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        ref = get_executor(reference)(lm32, shift32, edit, support)
        ref_logits = query_logits(lm32, ref, edit)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    del lm32, shift32
    errors = {}
    for role, name in (("native", native), ("custom", custom)):
        out = get_executor(name)(lm, shift, edit, support)
        per_layer = layer_errors(out, ref, absolute)
        stats = {
            (f"layer {r.layer} {r.tensor}", s): getattr(r, s)
            for r in per_layer.itertuples()
            for s in ("max_abs", "rms")
        }
        logits = _stats(query_logits(lm, out, edit), ref_logits)
        stats.update({("query logits", s): logits[s] for s in ("max_abs", "rms")})
        errors[role] = stats
        del out
    rows = []
    for key, native_err in errors["native"].items():
        custom_err = errors["custom"][key]
        ratio = custom_err / native_err if native_err > 0 else (0.0 if custom_err == 0 else math.inf)
        rows.append(
            {
                "quantity": key[0],
                "statistic": key[1],
                "native": native_err,
                "custom": custom_err,
                "ratio": ratio,
                "within_budget": ratio <= PROMOTION_BUDGET,
            }
        )
    ratios = pd.DataFrame(rows)
    worst = ratios.loc[ratios["ratio"].idxmax()]
    summary = pd.DataFrame(
        [
            {
                "custom": custom,
                "native": native,
                "max_ratio": float(worst["ratio"]),
                "worst": f"{worst['quantity']} {worst['statistic']}",
                "passed": bool(ratios["within_budget"].all()),
            }
        ]
    )
    return ratios, summary
