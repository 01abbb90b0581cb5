"""Recovery timings with :func:`sur_lab.repair.recover`: serial vs overlapped preparation (appendix 13.3,
:func:`overlap_recovery`) and recovery on real inputs beside Replay and Re-prefill (appendix 13.4, Table 20 analogue,
:func:`real_input_recovery`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from sur_lab.allocators import get_allocator
from sur_lab.cache_ops import caches_equal, clone_cache
from sur_lab.edits import EditedContext
from sur_lab.executors import dirty, get_executor, replay, reprefill
from sur_lab.models import LoadedModel
from sur_lab.repair import preparation_worker, recover
from sur_lab.studies.bench.timing import time_interleaved

__all__ = ["overlap_recovery", "real_input_recovery"]


def overlap_recovery(
    lm: LoadedModel,
    edit: EditedContext,
    *,
    budget_pct: float = 5.0,
    method: str = "SUR",
    executor: str = "packed",
    inplace: bool = True,
    warmups: int = 2,
    repeats: int = 10,
    seed: int = 0,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Serial vs overlapped recovery (appendix 13.3, "Preparation overlap") with :func:`sur_lab.repair.recover`.

    Each call gets a fresh copy of the Dirty cache in its untimed setup (so ``inplace=True`` can consume it);
    recovery covers Shift, relevance scoring, unit construction, allocation, planning and refresh, and excludes
    prefill, tokenization, worker creation and answering. Before timing, one serial and one overlapped call are
    compared: support and output cache bitwise (``identical``).

    Returns:
        ``(timings, summary)``: one row per timed call (``mode``, ``rep``, ``ms``, and the recover breakdown
        ``select_ms``, ``shift_ms``, ``refresh_ms``); summary has per mode ``median_ms``, the median breakdown,
        ``num_selected``, ``num_intervals``, ``context_len`` and ``identical``.
    """
    dirty_cache = dirty(lm, edit)
    preparation_worker()  # created outside any timing
    checks = {
        mode: recover(lm, edit, clone_cache(dirty_cache), method, budget_pct, executor=executor,
                      overlap=mode == "overlap", inplace=inplace, seed=seed)
        for mode in ("serial", "overlap")
    }
    a, b = checks["serial"], checks["overlap"]
    identical = bool(np.array_equal(a.support.positions, b.support.positions)) and caches_equal(a.cache, b.cache)
    support = a.support
    del checks, a, b
    breakdown: dict[tuple, dict] = {}

    def task(mode: str):
        def call(cache):
            result = recover(lm, edit, cache, method, budget_pct, executor=executor, overlap=mode == "overlap",
                             inplace=inplace, seed=seed)
            breakdown.setdefault((mode,), []).append(dict(result.timings_ms))
        return (lambda: clone_cache(dirty_cache), call)

    tasks = {("serial",): task("serial"), ("overlap",): task("overlap")}
    df = time_interleaved(tasks, warmups=warmups, repeats=repeats, seed=seed, device=lm.device, progress=progress)
    df["mode"] = [k[0] for k in df["key"]]
    for part in ("select", "shift", "refresh"):
        df[f"{part}_ms"] = np.nan
    for mode in ("serial", "overlap"):
        rows = breakdown[(mode,)][warmups:]
        idx = df.index[df["mode"] == mode]
        for part in ("select", "shift", "refresh"):
            df.loc[idx, f"{part}_ms"] = [r[part] for r in rows]
    df = df.drop(columns="key")
    summary = df.groupby("mode", sort=False)[["ms", "select_ms", "shift_ms", "refresh_ms"]].median()
    summary = summary.rename(columns={"ms": "median_ms"}).reset_index()
    summary = summary.assign(
        context_len=edit.edited_len, num_selected=support.size, num_intervals=support.num_intervals,
        identical=identical,
    )
    return df[["mode", "rep", "ms", "select_ms", "shift_ms", "refresh_ms"]], summary


def real_input_recovery(
    lm: LoadedModel,
    edits: Sequence[EditedContext],
    *,
    budgets: Sequence[float] = (2, 5),
    executors: Sequence[str] = ("sequential", "packed"),
    method: str = "SUR",
    warmups: int = 2,
    repeats: int = 5,
    seed: int = 0,
    labels: Sequence[str] | None = None,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> pd.DataFrame:
    """Recovery timing on real inputs (Table 20 analogue, appendix 13.4): per input, ``method`` at each budget with
    each executor, full-suffix Replay and Re-prefill, interleaved (:func:`time_interleaved`).

    An allocator row is :func:`sur_lab.repair.recover` from the input's Dirty cache (not modified): ``refresh_ms`` is
    the executor's refresh (planning and the output's own cache included), ``recovery_ms`` the whole call (Shift,
    relevance scoring, unit construction, allocation, refresh). Replay (the valid prefix plus the suffix recomputed)
    and Re-prefill (the edited prompt from an empty cache) have no selection stage: their refresh is their recovery.
    Prefill, tokenization and answering are excluded. ``traversals`` counts model traversals: the interval-wise
    ``sequential`` executor makes one per interval (R), every other path one.

    Args:
        lm: the model.
        edits: the inputs (e.g. :func:`sur_lab.studies.natural_qa.qa_inputs`' ``case.edit``).
        budgets: b values, % of the suffix.
        executors: executor names compared at each budget (interval-wise ``"sequential"`` and ``"packed"``).
        method: the allocator (SUR).
        warmups, repeats, seed, progress: as :func:`time_interleaved` (the paper: 2 and 5).
        labels: one name per input (default ``"input {i}"``).

    Returns:
        One row per timed call: ``input``, ``context_len`` (N, edited tokens), ``method``, ``budget_pct`` (NaN for
        the references), ``executor``, ``num_selected`` (B), ``num_intervals`` (R), ``traversals``, ``rep``,
        ``refresh_ms``, ``recovery_ms``.

    Raises:
        ValueError: naming ``edits`` when empty, ``labels`` when its length differs, or an unknown executor or
            method (before any timing); as :func:`time_interleaved`.
    """
    if not edits:
        raise ValueError("edits is empty: give at least one input")
    labels = list(labels) if labels is not None else [f"input {i}" for i in range(len(edits))]
    if len(labels) != len(edits):
        raise ValueError(f"labels has {len(labels)} names for {len(edits)} edits")
    for name in executors:
        get_executor(name)
    get_allocator(method)
    frames = []
    for label, edit in zip(labels, edits):
        cache = dirty(lm, edit)
        breakdown: dict[tuple, list] = {}

        def allocator_task(b: float, ex: str):
            def call():
                result = recover(lm, edit, cache, method, b, executor=ex, seed=seed)
                breakdown.setdefault((method, b, ex), []).append(
                    (result.timings_ms["refresh"], result.selection.support))
                return result
            return call

        tasks: dict[tuple, Callable[[], object]] = {
            (method, float(b), ex): allocator_task(float(b), ex) for b in budgets for ex in executors
        }
        tasks[("Replay", float("nan"), "sequential")] = lambda: replay(lm, cache, edit)
        tasks[("Re-prefill", float("nan"), "sequential")] = lambda: reprefill(lm, edit)
        df = time_interleaved(tasks, warmups=warmups, repeats=repeats, seed=seed, device=lm.device,
                              progress=progress)
        rows = []
        for key, group in df.groupby("key", sort=False):
            name, b, ex = key
            for rep, ms in zip(group["rep"], group["ms"]):
                if name == method:
                    refresh_ms, support = breakdown[key][warmups + rep]
                    B, R = support.size, support.num_intervals
                    traversals = R if ex == "sequential" else int(B > 0)
                else:
                    refresh_ms, B, R, traversals = ms, edit.suffix_len, 1, 1
                rows.append({"input": label, "context_len": edit.edited_len, "method": name, "budget_pct": b,
                             "executor": ex if name == method else "", "num_selected": B, "num_intervals": R,
                             "traversals": traversals, "rep": rep, "refresh_ms": refresh_ms, "recovery_ms": ms})
        frames.append(pd.DataFrame(rows))
        del cache
    return pd.concat(frames, ignore_index=True)
