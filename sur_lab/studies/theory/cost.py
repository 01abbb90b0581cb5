"""The cost model of budgeted recomputation (appendix 13.1, Eq. 15-19) and the traversal-overhead fit.

Token-layer ratio (Eq. 15), useful-arithmetic FLOPs (Eq. 16-17, formula in :func:`token_flops`), the causal-pair count
``M(U) = Σ_{u∈U} (u + 1)`` and its bound (Eq. 18), and the traversal-overhead model (Eq. 19) fitted by non-negative
least squares to measured refresh times (:func:`fit_traversal_model`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from scipy.optimize import lsq_linear
from tqdm.auto import tqdm
from transformers import DynamicCache

from sur_lab.budget import Support, allowance, spread_support
from sur_lab.edits import EditedContext
from sur_lab.executors import get_executor
from sur_lab.models import LoadedModel

# ---------------------------------------------------------------------------------------------------------------------
# Cost model (appendix 13.1, Eq. 15–19)


def token_layer_ratio(allowance_b: int, suffix_len: int) -> float:
    """Refreshed token-layer positions over full-suffix Replay, ``L·B / (L·S) = B / S`` (Eq. 15).

    Raises:
        ValueError: naming ``suffix_len`` (must be ≥ 1) or ``allowance_b`` (must lie in [0, S]).
    """
    if suffix_len < 1:
        raise ValueError(f"suffix_len={suffix_len} must be >= 1")
    if not 0 <= allowance_b <= suffix_len:
        raise ValueError(f"allowance_b={allowance_b} must lie in [0, {suffix_len}]")
    return allowance_b / suffix_len


def causal_pairs(positions: np.ndarray | Sequence[int]) -> int:
    """Legal causal query–key pairs of a set of query rows, per head: ``M(U) = Σ_{u∈U} (u + 1)`` (Eq. 17–18).

    ``positions`` are zero-based absolute rows in the edited context (``U``, i.e. ``p + suffix-local``); query u
    reads keys ``0 .. u``. With one-based suffix index ``i``, ``u + 1 = P + i``, so this is ``Σ_{i∈A} (P + i)``.

    Raises:
        ValueError: naming ``positions`` when one is negative.
    """
    u = np.asarray(positions, dtype=np.int64).reshape(-1)
    if len(u) and u.min() < 0:
        raise ValueError(f"positions must be >= 0; got min {int(u.min())}")
    return int((u + 1).sum())


def replay_pairs(prefix_len: int, suffix_len: int) -> int:
    """Causal pairs of full-suffix Replay per head: ``S·P + S(S + 1)/2`` (appendix 13.1)."""
    return suffix_len * prefix_len + suffix_len * (suffix_len + 1) // 2


def max_pairs(prefix_len: int, suffix_len: int, allowance_b: int) -> int:
    """The largest causal-pair count of any size-B support, ``B(P + S) − B(B − 1)/2`` (the last B positions, Eq. 18).

    Raises:
        ValueError: naming ``allowance_b`` when outside [0, S].
    """
    if not 0 <= allowance_b <= suffix_len:
        raise ValueError(f"allowance_b={allowance_b} must lie in [0, {suffix_len}]")
    return allowance_b * (prefix_len + suffix_len) - allowance_b * (allowance_b - 1) // 2


def pair_ratio_bound(allowance_b: int, suffix_len: int) -> float:
    """``min(1, 2B/S)``, the support-independent bound on the causal-pair ratio (Eq. 18)."""
    return min(1.0, 2.0 * allowance_b / suffix_len)


def _config_value(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def token_flops(lm_or_config: Any) -> int:
    """Useful FLOPs per token per layer outside attention pairs (the ``d²`` term of Eq. 16–17).

    Formula (multiply–add = 2 FLOPs): Q and O projections ``2 · 2 · d · H_Q d_h``, K and V projections
    ``2 · 2 · d · H_KV d_h``, gated MLP (gate, up, down) ``2 · 3 · d · d_ff``. Norms, RoPE, activations and the LM head
    are not counted (repair needs no logits).

    Args:
        lm_or_config: a :class:`LoadedModel` or a transformers config (Llama/Qwen style fields).
    """
    config = lm_or_config.model.config if isinstance(lm_or_config, LoadedModel) else lm_or_config
    d = config.hidden_size
    h_q = config.num_attention_heads
    h_kv = _config_value(config, "num_key_value_heads", default=h_q)
    d_h = _config_value(config, "head_dim", default=d // h_q)
    d_ff = config.intermediate_size
    return 2 * 2 * d * h_q * d_h + 2 * 2 * d * h_kv * d_h + 2 * 3 * d * d_ff


def pair_flops(lm_or_config: Any) -> int:
    """Useful FLOPs per causal query–key pair per layer (the ``d · Σ(P + i)`` term): ``QKᵀ`` and ``αV`` over all query
    heads, ``2 · 2 · H_Q · d_h``."""
    config = lm_or_config.model.config if isinstance(lm_or_config, LoadedModel) else lm_or_config
    h_q = config.num_attention_heads
    d_h = _config_value(config, "head_dim", default=config.hidden_size // h_q)
    return 2 * 2 * h_q * d_h


def useful_flops(lm_or_config: Any, prefix_len: int, positions: np.ndarray | Sequence[int]) -> int:
    """Idealized useful arithmetic of recomputing query rows ``positions`` (Eq. 16–17), FLOPs.

    ``F = L · [B · token_flops + pair_flops · M(U)]`` with B = ``len(positions)`` and ``M(U)`` = :func:`causal_pairs`.
    Full-suffix Replay is ``positions = p .. p + S − 1`` (Eq. 16); a support's refresh is ``p + support`` (Eq. 17).

    Args:
        lm_or_config: the model or its config.
        prefix_len: P (only checked: positions are absolute already).
        positions: absolute rows, each ≥ ``prefix_len``.

    Raises:
        ValueError: naming ``positions`` when one lies in the prefix.
    """
    config = lm_or_config.model.config if isinstance(lm_or_config, LoadedModel) else lm_or_config
    u = np.asarray(positions, dtype=np.int64).reshape(-1)
    if len(u) and u.min() < prefix_len:
        raise ValueError(f"positions must be >= prefix_len={prefix_len}; got {int(u.min())}")
    return config.num_hidden_layers * (len(u) * token_flops(config) + pair_flops(config) * causal_pairs(u))


def cost_table(lm: LoadedModel, edit: EditedContext, supports: dict[Any, Support]) -> "pd.DataFrame":  # noqa: F821
    """The cost model of appendix 13.1 for each support of ``edit``.

    Returns:
        DataFrame, one row per support: ``label, B, S, P, R, token_layer_ratio`` (Eq. 15), ``flops_refresh,
        flops_replay, flops_ratio`` (Eq. 16–17), ``pairs, pairs_replay, pair_ratio, pair_ratio_max`` (the last-B
        support) and ``pair_ratio_bound`` (``min(1, 2B/S)``, Eq. 18).
    """
    P, S = edit.prefix_len, edit.suffix_len
    full = np.arange(P, P + S)
    f_replay = useful_flops(lm, P, full)
    m_replay = replay_pairs(P, S)
    rows = []
    for label, sup in supports.items():
        u = sup.absolute(P)
        B = sup.size
        f = useful_flops(lm, P, u)
        m = causal_pairs(u)
        rows.append({
            "label": label, "B": B, "S": S, "P": P, "R": sup.num_intervals,
            "token_layer_ratio": token_layer_ratio(B, S),
            "flops_refresh": f, "flops_replay": f_replay, "flops_ratio": f / f_replay,
            "pairs": m, "pairs_replay": m_replay, "pair_ratio": m / m_replay,
            "pair_ratio_max": max_pairs(P, S, B) / m_replay, "pair_ratio_bound": pair_ratio_bound(B, S),
        })
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------------------
# Traversal-overhead model (Eq. 19)

#: Packed executors picked up automatically when their module registers them.
PACKED_EXECUTORS = ("packed-sdpa",)


def available_executors() -> list[str]:
    """``"sequential"`` plus every packed executor of :data:`PACKED_EXECUTORS` that is registered now."""
    names = ["sequential"]
    for name in PACKED_EXECUTORS:
        try:
            get_executor(name)
        except ValueError:
            continue
        names.append(name)
    return names


def time_refresh(
    lm: LoadedModel, shift_cache: DynamicCache, edit: EditedContext, support: Support, executor: str = "sequential",
    *, repeats: int = 3, warmup: int = 1,
) -> list[float]:
    """Wall-clock refresh times (ms) of ``executor`` on ``support``, after ``warmup`` untimed runs.

    CUDA work is synchronized before each clock read. Returns ``repeats`` times in ms.

    Raises:
        ValueError: naming ``executor`` when it is not registered (see :func:`sur_lab.executors.get_executor`).
    """
    run = get_executor(executor)
    sync = torch.cuda.synchronize if lm.device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        run(lm, shift_cache, edit, support)
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


@dataclass(frozen=True)
class TraversalFit:
    """Eq. 19 fitted by non-negative least squares: ``T ≈ c₀ + traversals · H + Σ_e [c_B,e · B + c_M,e · M(U)]``.

    ``traversals`` is R for the interval-wise executor and 1 for a packed one; ``c₀`` is a support-independent cost
    shared by all executors (the clone of the output cache); ``c_B,e`` (ms per refreshed position: projections and
    MLP of all layers) and ``c_M,e`` (ms per causal pair) are the compute term ``C_e(A)`` of executor e.

    Attributes:
        h_ms: H, fixed overhead per traversal, ms (in the interval-wise executor it includes the copy of the cache
            prefix each interval reads).
        c0_ms: c₀, ms.
        per_position_ms: ``{executor: c_B}``, ms per refreshed position.
        per_pair_ms: ``{executor: c_M}``, ms per causal pair.
        r2: coefficient of determination of the fit on its own data.
        num_points: measurements fitted.
    """

    h_ms: float
    c0_ms: float
    per_position_ms: dict[str, float]
    per_pair_ms: dict[str, float]
    r2: float
    num_points: int

    def predict(self, executor: str, traversals, allowance_b, pairs) -> np.ndarray:
        """Predicted refresh time (ms) of ``executor`` for arrays of traversals, B and M(U)."""
        return (
            self.c0_ms
            + np.asarray(traversals, dtype=np.float64) * self.h_ms
            + self.per_position_ms[executor] * np.asarray(allowance_b, dtype=np.float64)
            + self.per_pair_ms[executor] * np.asarray(pairs, dtype=np.float64)
        )


#: Executors that traverse the model once per interval (appendix 7.1 and 13.3); every other one packs all intervals
#: into one layer-major traversal.
INTERVAL_WISE_EXECUTORS = ("sequential", "direct-sequential")


def traversals(executor: str, num_intervals: int) -> int:
    """Model traversals an executor makes for a support of R intervals (Eq. 19).

    R for the interval-wise executors (:data:`INTERVAL_WISE_EXECUTORS`: ``"sequential"`` and its in-place control
    ``"direct-sequential"``), 1 for the packed ones (``"packed-*"``, ``"one-shot"``).

    Raises:
        ValueError: naming ``executor`` when it is not a registered executor, or ``num_intervals`` when it is not an
            integer >= 0.
    """
    get_executor(executor)  # ValueError naming the registered executors
    if isinstance(num_intervals, (bool, np.bool_)) or int(num_intervals) != num_intervals or num_intervals < 0:
        raise ValueError(f"num_intervals must be an integer >= 0; got {num_intervals!r}")
    return int(num_intervals) if executor in INTERVAL_WISE_EXECUTORS else 1


def fit_traversal_model(df) -> TraversalFit:
    """Fit Eq. 19 to measured refresh times by non-negative least squares (``scipy.optimize.lsq_linear``).

    Args:
        df: DataFrame with columns ``executor, R, B, pairs, ms`` (one row per measurement).

    Returns:
        :class:`TraversalFit`.

    Raises:
        ValueError: naming ``df`` when it lacks a column or has fewer rows than parameters.
    """
    for col in ("executor", "R", "B", "pairs", "ms"):
        if col not in df.columns:
            raise ValueError(f"df lacks column {col!r}")
    execs = list(dict.fromkeys(df["executor"]))
    n_params = 2 + 2 * len(execs)
    if len(df) < n_params:
        raise ValueError(f"df has {len(df)} rows; the model has {n_params} parameters")
    # Columns scaled to unit maximum so that ms-per-pair (~1e-6) and ms-per-traversal (~10) are fitted alike.
    X = np.zeros((len(df), n_params))
    X[:, 0] = 1.0
    X[:, 1] = [traversals(e, r) for e, r in zip(df["executor"], df["R"])]
    for k, e in enumerate(execs):
        sel = (df["executor"] == e).to_numpy()
        X[sel, 2 + 2 * k] = df.loc[sel, "B"]
        X[sel, 3 + 2 * k] = df.loc[sel, "pairs"]
    y = df["ms"].to_numpy(dtype=np.float64)
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    res = lsq_linear(X / scale, y, bounds=(0.0, np.inf), method="bvls")
    coef = res.x / scale
    pred = X @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return TraversalFit(
        h_ms=float(coef[1]),
        c0_ms=float(coef[0]),
        per_position_ms={e: float(coef[2 + 2 * k]) for k, e in enumerate(execs)},
        per_pair_ms={e: float(coef[3 + 2 * k]) for k, e in enumerate(execs)},
        r2=1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
        num_points=len(df),
    )


def timing_study(
    lm: LoadedModel,
    prepared,
    budgets: Sequence[float],
    intervals: Sequence[int],
    *,
    executors: Sequence[str] | None = None,
    extra_supports: dict[Any, Support] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    progress: bool = True,
) -> "pd.DataFrame":  # noqa: F821
    """Measure refresh times over R for synthetic supports (:func:`spread_support`) at each budget, per executor.

    Args:
        lm, prepared: the model and the prepared edit (not modified).
        budgets: budgets b (%) whose allowances are timed.
        intervals: R values; those that do not fit a budget's allowance are skipped.
        executors: executor names (default :func:`available_executors`).
        extra_supports: further ``{label: Support}`` to time (e.g. real SUR supports), labelled ``kind="extra"``.
        repeats: timed runs per support and executor.
        warmup: untimed runs of the first support of each executor (later supports reuse the warmed-up state).

    Returns:
        DataFrame, one row per measurement: ``executor, kind, label, budget_pct, B, R, pairs, repeat, ms``.
    """
    edit = prepared.edit
    S, P = edit.suffix_len, edit.prefix_len
    executors = list(executors or available_executors())
    cases: list[tuple[str, Any, float, Support]] = []
    for b in budgets:
        B = allowance(S, b)
        for r in intervals:
            try:
                cases.append(("spread", f"b={b}%,R={r}", float(b), spread_support(S, B, r)))
            except ValueError:
                continue
    for label, sup in (extra_supports or {}).items():
        cases.append(("extra", label, float("nan"), sup))
    rows = []
    warm = set()
    for kind, label, b, sup in tqdm(cases, desc="timing", disable=not progress):
        m = causal_pairs(sup.absolute(P))
        for ex in executors:
            w = 0 if ex in warm else warmup
            warm.add(ex)
            for i, ms in enumerate(time_refresh(lm, prepared.shift_cache, edit, sup, ex, repeats=repeats, warmup=w)):
                rows.append({"executor": ex, "kind": kind, "label": str(label), "budget_pct": b, "B": sup.size,
                             "R": sup.num_intervals, "pairs": m, "repeat": i, "ms": ms})
    return pd.DataFrame(rows)

__all__ = [
    "PACKED_EXECUTORS",
    "TraversalFit",
    "available_executors",
    "causal_pairs",
    "cost_table",
    "fit_traversal_model",
    "max_pairs",
    "pair_flops",
    "pair_ratio_bound",
    "replay_pairs",
    "time_refresh",
    "timing_study",
    "token_flops",
    "token_layer_ratio",
    "traversals",
    "useful_flops",
]
