"""Evidence location across models (appendix 10.1-10.2): finished per-model runs pooled on their common feasible
panel, the sources every run's tokenizer could build, and Tables 15-16 and the findings of the pooled estimand.

Each run's sweep wrote its panel file (:data:`~sur_lab.studies.evidence_location.study.PANEL_FILE`); :func:`combine`
reads the runs back, checks that they differ only in the model, and keeps the common panel's records
(:func:`common_panel`); :func:`pooled_report` reports them as one run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from sur_lab.studies.evidence_location.report import (
    COMPLETE_REPLAY,
    FIXED_SLOT_LABEL,
    factorial_table,
    findings,
    results_table,
    slot_gap_table,
    table16,
)
from sur_lab.studies.evidence_location.study import (
    EXCLUDED,
    FEASIBLE,
    NOT_EXAMINED,
    PANEL_FILE,
    read_panel_file,
)
from sur_lab.sweeps.record import CONFIG_FIELDS, MODEL_FIELDS
from sur_lab.sweeps.store import read_records

__all__ = ["common_panel", "PooledRuns", "combine", "pooled_report"]

def common_panel(panels: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    """Every candidate any run examined, with each run's outcome, and the **common feasible panel**: the sources
    every run's tokenizer could build (appendix 10.1's common panel; by tokenization alone).

    A candidate one run did not examine (a run with ``sources_per_dataset`` stops at its own n-th feasible source)
    is not in the common panel: with early stopping the panel is the common feasible sources among the candidates
    every run examined; without it (the ``paper`` preset) every run examines the same pool.

    Args:
        panels: model label -> its :func:`~sur_lab.studies.evidence_location.study.panel_record` (at least one).

    Returns:
        One row per examined candidate, datasets in the first record's order and candidates in order of first
        appearance: ``dataset``, ``source_id``, one column per model with :data:`FEASIBLE`, :data:`EXCLUDED` or
        :data:`NOT_EXAMINED`, and ``common`` (bool: feasible for every model).

    Raises:
        ValueError: naming ``panels`` when empty or when a record lacks ``candidates``.
    """
    if not panels:
        raise ValueError("panels is empty: give one panel record per model")
    order: dict[tuple[str, str], None] = {}
    status: dict[str, dict[tuple[str, str], str]] = {}
    for model, record in panels.items():
        candidates = record.get("candidates") if isinstance(record, Mapping) else None
        if not isinstance(candidates, Mapping):
            raise ValueError(f"panels[{model!r}] has no 'candidates' (not a panel_record)")
        status[model] = {}
        for d, outcome in candidates.items():
            for kind in (FEASIBLE, EXCLUDED):
                for sid in outcome.get(kind, ()):
                    order.setdefault((str(d), str(sid)), None)
                    status[model][str(d), str(sid)] = kind
    first = [str(d) for d in next(iter(panels.values()))["candidates"]]
    rank = {d: i for i, d in enumerate(first)}
    keys = sorted(order, key=lambda k: rank.get(k[0], len(rank)))  # stable: draw order within a dataset
    rows = []
    for d, sid in keys:
        row = {"dataset": d, "source_id": sid}
        row.update({m: status[m].get((d, sid), NOT_EXAMINED) for m in panels})
        row["common"] = all(row[m] == FEASIBLE for m in panels)
        rows.append(row)
    return pd.DataFrame(rows, columns=["dataset", "source_id", *panels, "common"])


@dataclass(frozen=True)
class PooledRuns:
    """Several models' finished runs on their common feasible panel (:func:`combine`).

    Attributes:
        records: every run's records on the common panel, in folder order (``model`` tells the runs apart); the
            report functions (:func:`results_table`, :func:`factorial_table`, :func:`table16`, :func:`findings`)
            read it as they read one run's, and their source bootstrap carries a source's cells of every model
            together (:func:`sur_lab.analysis.stats.factorial_bootstrap`).
        panel: :func:`common_panel` of the runs.
        folders: the sweep folders, in order.
        models: the model of each folder.
        params: the runs' common parameters (:func:`~sur_lab.studies.evidence_location.study.panel_record`'s
            ``params``) and ``seed``.
    """

    records: pd.DataFrame = field(repr=False)
    panel: pd.DataFrame = field(repr=False)
    folders: tuple
    models: tuple[str, ...]
    params: dict = field(repr=False)

    def summary(self) -> pd.DataFrame:
        """One row per dataset: the feasible sources of each model's run (``feasible: MODEL``), the ``common`` panel,
        the ``units`` it gives (sources x models), the sources ``dropped`` (feasible for some run but not all), and
        the common sources ``built at another geometry`` by some model (each tokenizer picks its own, appendix
        10.1)."""
        geometry = self.records.groupby(["dataset", "source_id"])["geometry"].nunique()
        rows = []
        for d, g in self.panel.groupby("dataset", sort=False):
            row = {"dataset": d}
            row.update({f"feasible: {m}": int((g[m] == FEASIBLE).sum()) for m in self.models})
            common = g[g["common"]]
            row["common"] = len(common)
            row["units"] = len(common) * len(self.models)
            row["dropped"] = int(((g[list(self.models)] == FEASIBLE).any(axis=1) & ~g["common"]).sum())
            row["built at another geometry"] = int(sum(geometry.get((d, s), 1) > 1 for s in common["source_id"]))
            rows.append(row)
        return pd.DataFrame(rows)


def combine(folders: Sequence) -> PooledRuns:
    """Pool finished per-model runs of this study on their common feasible panel (appendix 10.1: three models on 275
    common sources, 825 source-model units).

    Each folder is one model's finished sweep (notebook 08 or ``sur-lab sweep evidence-location``): its
    ``records.parquet`` and :data:`PANEL_FILE`. The runs must differ only in the model: the same study parameters
    (:func:`~sur_lab.studies.evidence_location.study.panel_record`;
    :data:`~sur_lab.studies.evidence_location.study.ANALYSIS_PARAMS` aside) and seed, and the same value of every
    record fingerprint field outside :data:`~sur_lab.sweeps.record.MODEL_FIELDS` (executor, decoding limit and rule,
    evaluation batch, options, versions). The pooled records keep the sources every run's tokenizer could build
    (:func:`common_panel`); a source one model could not build is dropped for every model, so the models' cells stay
    paired by source.

    Args:
        folders: two or more sweep folders, one per model.

    Returns:
        :class:`PooledRuns`.

    Raises:
        ValueError: naming ``folders`` when fewer than two are given or one repeats; when a folder holds several
            models, or two hold the same model (name or weights); when a parameter, the seed or a fingerprint field
            differs (naming it and both folders); when a folder's records and panel file disagree on its sources, or
            the method grids differ; when the common panel is empty.
        FileNotFoundError: for a folder without ``records.parquet`` (its sweep has not finished) or without
            :data:`PANEL_FILE`.
    """
    if isinstance(folders, (str, Path)) or not isinstance(folders, Sequence):
        raise ValueError(f"folders={folders!r} must be a list of sweep folders, one per model")
    paths = [Path(f) for f in folders]
    if len(paths) < 2:
        raise ValueError(f"folders holds {len(paths)} folder(s): the pooled estimand needs the runs of >= 2 models")
    if len({p.resolve() for p in paths}) != len(paths):
        raise ValueError(f"folders repeat a folder: {[str(p) for p in paths]}")
    frames = [read_records(p) for p in paths]
    records = [read_panel_file(p) for p in paths]
    shared = [f for f in CONFIG_FIELDS if f not in MODEL_FIELDS]
    models: list[str] = []
    seen: dict[str, Path] = {}
    for path, df, rec in zip(paths, frames, records):
        weights = sorted(set(df["model_weights"]))
        if len(weights) != 1 or df["model"].nunique() != 1:
            raise ValueError(f"folders: {path} holds {len(weights)} models ({sorted(set(df['model']))}); one per "
                             "folder")
        name = str(df["model"].iloc[0])
        for key in (weights[0], name):
            if key in seen:
                raise ValueError(f"folders: {path} and {seen[key]} hold the same model ({name})")
            seen[key] = path
        models.append(name)
        for label, a, b in (("parameter", rec["params"], records[0]["params"]),
                            ("parameter", {"seed": rec["seed"]}, {"seed": records[0]["seed"]})):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    raise ValueError(f"folders: {label} {k!r} differs between {paths[0]} ({b.get(k)!r}) and {path} "
                                     f"({a.get(k)!r}); pooled runs differ only in the model")
        for f in shared:
            values = sorted(set(map(str, df[f])))
            if len(values) != 1:
                raise ValueError(f"folders: {path} holds several values of {f!r} ({values})")
            ref = str(frames[0][f].iloc[0])
            if values[0] != ref:
                raise ValueError(f"folders: {f!r} differs between {paths[0]} ({ref!r}) and {path} ({values[0]!r}); "
                                 f"only the model ({', '.join(MODEL_FIELDS)}) may differ")
        ran = set(zip(df["dataset"].astype(str), df["source_id"].astype(str)))
        listed = {(d, str(s)) for d, c in rec["candidates"].items() for s in c.get(FEASIBLE, ())}
        if ran != listed:
            raise ValueError(f"folders: {path}'s records cover {len(ran)} sources and its {PANEL_FILE} lists "
                             f"{len(listed)} feasible ones ({len(ran ^ listed)} differ): an unfinished sweep or a "
                             "panel file of another call")
        grid = {(m, "ref" if pd.isna(b) else float(b)) for m, b in zip(df["method"], df["budget_pct"])}
        first = {(m, "ref" if pd.isna(b) else float(b)) for m, b in zip(frames[0]["method"], frames[0]["budget_pct"])}
        if grid != first:
            raise ValueError(f"folders: {paths[0]} and {path} hold different (method, budget) grids: "
                             f"{sorted(map(str, grid ^ first))[:6]}")
    panel = common_panel(dict(zip(models, records)))
    common = set(zip(panel.loc[panel["common"], "dataset"], panel.loc[panel["common"], "source_id"]))
    if not common:
        raise ValueError(f"folders: the runs of {models} have no feasible source in common")
    pooled = []
    for df in frames:
        keys = zip(df["dataset"].astype(str), df["source_id"].astype(str))
        pooled.append(df[[k in common for k in keys]])
    return PooledRuns(pd.concat(pooled, ignore_index=True), panel, tuple(paths), tuple(models),
                      {**records[0]["params"], "seed": records[0]["seed"]})


# ---------------------------------------------------------------------------------------------------------------------

def pooled_report(pooled: PooledRuns, *, n_boot: int = 10_000, seed: int = 20260928,
                  decide: bool = True) -> dict[str, pd.DataFrame]:
    """Tables 15-16 and the findings of the pooled estimand (appendix 10.2): every model's cells on the common panel,
    averaged within source, dataset and model with equal weights, intervals from the source bootstrap that carries a
    source's cells of every model together.

    Args:
        pooled: :func:`combine`'s result.
        n_boot: bootstrap replicates; seed: generator seed.
        decide: ``False`` at a plumbing-check size (:func:`sur_lab.analysis.decisions.decides`).

    Returns:
        ``{"panel": pooled.summary(), "table15": factorial_table, "table16": table16, "findings": findings}``; the
        fixed-slot rows and finding only when the runs ran the fixed slot.
    """
    table = results_table(pooled.records)
    conditions = [COMPLETE_REPLAY] + ([FIXED_SLOT_LABEL] if FIXED_SLOT_LABEL in set(table["condition"]) else [])
    t15 = factorial_table(table, conditions, n_boot=n_boot, seed=seed)
    t16 = table16(table, conditions, n_boot=n_boot, seed=seed)
    gaps = slot_gap_table(table, n_boot=n_boot, seed=seed) if FIXED_SLOT_LABEL in conditions else None
    return {"panel": pooled.summary(), "table15": t15, "table16": t16,
            "findings": findings(t15, t16, gaps, decide=decide)}
