"""The local scheduler: the cases of a sweep, one after another, in this process.

It reads what the store holds, checks it against this run's fingerprint, hands each case's missing records to
:func:`sur_lab.sweeps.case.run_case` and each finished record to the store. Nothing else: the records are made by
``run_case``, kept by :class:`sur_lab.sweeps.store.SweepStore`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from sur_lab.models import LoadedModel
from sur_lab.sweeps.case import Case, grid_keys, run_case, shared_prefix
from sur_lab.sweeps.record import Record, config_fields
from sur_lab.sweeps.store import SweepStore, check_fingerprint


def run_local(
    lm: LoadedModel,
    cases: Sequence[Case],
    methods: Sequence[str],
    budgets: Sequence[float],
    store: SweepStore,
    *,
    case_args: Mapping[str, Any],
    timed: frozenset[str],
    manifest: Mapping[str, Any],
    progress: bool = True,
) -> pd.DataFrame:
    """Run every case's missing records of the (method, budget) grid here; returns the consolidated records.

    Args:
        lm: the model.
        cases: the cases (checked by the caller).
        methods, budgets: as :func:`run_case` (checked by the caller).
        store: the sweep folder's store.
        case_args: :func:`run_case` keyword arguments (``executor``, ``max_new_tokens``, ``eval_batch``, ``seed``,
            ``options``, ``scorer``, ``parser``, ``share_prefix``).
        timed: ids of the cases whose answers are timed per request.
        manifest: extra ``sweep.json`` entries (methods, budgets...).
        progress: show a tqdm bar over records.

    Raises:
        ValueError: naming ``out_dir`` and the first differing field when the folder holds records made with another
            configuration (before any model call).
        RuntimeError: when another process is sweeping into the folder.
    """
    config = config_fields(lm, **{k: case_args[k] for k in ("seed", "executor", "max_new_tokens", "eval_batch",
                                                              "options")})
    keys = grid_keys(methods, budgets)
    with store.lock():
        store.adopt_consolidated(config)  # before anything can overwrite a records.parquet without parts
        stored = {c.case_id: store.read(c.case_id, c.meta.keys()) for c in cases}
        for case in cases:
            per_request = case.case_id in timed or config["eval_batch"] == 1
            expected = {**config, "case_fingerprint": case.fingerprint(), "timed": per_request,
                        "shared_prefix": shared_prefix(case_args.get("share_prefix", True), per_request)}
            check_fingerprint(stored[case.case_id].values(), expected, out_dir=store.out_dir, case_id=case.case_id)
        store.write_manifest(config, **manifest, workers=1)
        done = sum(sum(k in stored[c.case_id] for k in keys) for c in cases)
        bar = tqdm(total=len(cases) * len(keys), initial=done, disable=not progress, desc="sweep", unit="record")

        def emit(record: Record) -> None:
            store.append(record)
            bar.update(1)

        try:
            for case in cases:
                skip = set(stored[case.case_id])
                if all(k in skip for k in keys):
                    continue
                bar.set_postfix_str(case.case_id)
                run_case(lm, case, methods, budgets, **case_args, timed=case.case_id in timed, skip=skip,
                         emit=emit)
        finally:
            bar.close()
        return store.consolidate([c.case_id for c in cases], keys)


__all__ = ["run_local"]
