"""``run_sweep``: cases x methods x budgets into one sweep folder, on this process or on Ray actors, resumable.

It checks every argument before any work, then hands the cases to a scheduler (:func:`sur_lab.sweeps.local.run_local`
for ``workers=1``, :func:`sur_lab.sweeps.ray.run_ray` otherwise); both make the records with
:func:`sur_lab.sweeps.case.run_case` and keep them in :class:`sur_lab.sweeps.store.SweepStore`, so the records do not
depend on the scheduler (only ``workers``/``threads`` say how they were measured).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sur_lab.fingerprint import dtype_reason
from sur_lab.models import LoadedModel
from sur_lab.sweeps.case import EVAL_BATCH, Case, Method, check_run_args, method_name
from sur_lab.sweeps.local import run_local
from sur_lab.sweeps.ray import check_workers, run_ray
from sur_lab.sweeps.store import SweepStore


def timed_set(cases: Sequence[Case], timed: bool | Collection[str]) -> frozenset[str]:
    """The ids of the cases whose answers are timed per request: all (``True``), none (``False``) or the given ids.

    Raises:
        ValueError: naming ``timed`` when it holds an id that is not a case's.
    """
    ids = [c.case_id for c in cases]
    if timed is True:
        return frozenset(ids)
    if timed is False or timed is None:
        return frozenset()
    if isinstance(timed, str):
        raise ValueError(f"timed must be True, False or a collection of case ids; got the string {timed!r}")
    unknown = sorted(set(timed) - set(ids))
    if unknown:
        raise ValueError(f"timed names case ids that are not among the cases: {unknown[:5]}")
    return frozenset(timed)


def seeded_subset(ids: Sequence[str], k: int | None, seed: int = 0) -> list[str]:
    """A declared, seeded subset of ``k`` ids (e.g. the cases whose answers a study times per request).

    The first ``k`` ids of a permutation seeded by ``seed`` and the ids themselves (independent of any model output),
    in input order. Nested: the subset of k is part of the subset of k + 1. ``k=None`` (or ``k >= len(ids)``) is every
    id; ``k=0`` none.

    Raises:
        ValueError: naming ``k`` when it is negative or not an integer.
    """
    if k is None:
        return list(ids)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be None (every id) or an integer >= 0; got {k!r}")
    keys = [int(np.random.SeedSequence([int(seed), zlib.crc32(i.encode())]).generate_state(1)[0]) for i in ids]
    chosen = set(sorted(range(len(ids)), key=lambda j: (keys[j], j))[: int(k)])
    return [i for j, i in enumerate(ids) if j in chosen]


def run_sweep(
    lm: Any,
    cases: Sequence[Case],
    methods: Sequence[str | Method],
    budgets: Sequence[float],
    out_dir: Path | str,
    *,
    max_new_tokens: int = 64,
    executor: str = "sequential",
    eval_batch: int = EVAL_BATCH,
    timed: bool | Collection[str] = False,
    scorer: Callable[[Case, str], bool] | None = None,
    parser: Callable[[str], Any] | None = None,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
    progress: bool = True,
    workers: int = 1,
    address: str | None = None,
    threads: int | None = None,
    share_prefix: bool = True,
) -> pd.DataFrame:
    """Run every (case, method, budget), persisting each record as it finishes; resume what a previous call left.

    Args:
        lm: the model; with Ray (``workers > 1`` or an ``address``) also a mapping of :func:`sur_lab.models.load_model`
            arguments (the driver then loads no model).
        cases: the cases (unique ``case_id``).
        methods, budgets, max_new_tokens, executor, eval_batch, scorer, parser, seed, options: as
            :func:`sur_lab.sweeps.case.run_case`.
        out_dir: the sweep folder (created; :func:`sur_lab.sweeps.store.sweep_folder` names one).
        timed: which cases have their answers timed per request (Eq. 20 latency): ``True`` (every case),
            ``False`` (none: answer timings are NaN unless ``eval_batch`` is 1) or a collection of case ids (a
            declared subset).
        progress: show a tqdm bar over records.
        workers, address, threads: ``workers > 1`` or an ``address`` runs the cases on Ray actors
            (:func:`sur_lab.sweeps.ray.run_ray`: same records and files); ``workers=1`` without an address runs here.
        share_prefix: exact prefix sharing inside each untimed case (:func:`sur_lab.sweeps.case.run_case`; default
            on); part of each record's fingerprint (:attr:`sur_lab.sweeps.record.Record.shared_prefix`).

    Returns:
        The requested records as a DataFrame (cases in order, then the method grid in order; columns of
        :func:`sur_lab.sweeps.record.records_frame`), also written to ``out_dir/records.parquet``.

    Raises:
        ValueError: for an unknown method or executor, a budget outside [0, 100], ``max_new_tokens`` or ``eval_batch``
            < 1, duplicate case ids, a ``timed`` id that is not a case's, bad ``workers``/``address``/``threads``
            (all before any model call), or naming ``out_dir`` and the first differing field when it holds records made
            with another configuration (part files, or a ``records.parquet`` without them).
        FolderInUseError: (a ``RuntimeError``) naming ``out_dir`` when another process is running a sweep into it
            (nothing is written).
    """
    grid = check_run_args(cases, methods, budgets, executor, max_new_tokens, eval_batch)
    timed_ids = timed_set(cases, timed)
    case_args = dict(executor=executor, max_new_tokens=int(max_new_tokens), eval_batch=int(eval_batch),
                     seed=int(seed), options=options, scorer=scorer, parser=parser, share_prefix=bool(share_prefix))
    manifest = dict(methods=[method_name(m) for m in methods], budgets=[float(b) for b in budgets], cases=[c.case_id for c in cases],
                    timed_cases=sorted(timed_ids), share_prefix=bool(share_prefix),
                    records_planned=len(cases) * len(grid))  # a watcher's progress total
    if isinstance(lm, LoadedModel):
        manifest["dtype_reason"] = dtype_reason(lm)
    store = SweepStore(out_dir)
    if type(workers) is not int or workers != 1 or address is not None:
        check_workers(workers, address, threads)
        return run_ray(lm, cases, methods, budgets, store, case_args=case_args, timed=timed_ids, manifest=manifest,
                       workers=workers, address=address, threads=threads, progress=progress)

    return run_local(lm, cases, methods, budgets, store, case_args=case_args, timed=timed_ids, manifest=manifest,
                     progress=progress)


__all__ = ["run_sweep", "seeded_subset", "timed_set"]
