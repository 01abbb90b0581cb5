"""What each study's run cost, and what it can decide (issues 40 and 41): one row per notebook that has a study, read
from a results folder, never typed.

For every notebook of a :class:`sur_lab.studies.base.Study` in :data:`sur_lab.studies.STUDIES`, :func:`sizes_table`
reads from a release folder (``results/`` or a ``--preset smoke --results DIR`` one) and its manifest:

- **cases**: the distinct ``case_id`` values of the study's records (``study.table_file``, ``records.parquet`` for most)
  in its sweep folder under ``sweeps/`` (:func:`case_count`; the folder its parameters name, :func:`folder_stem`); the
  case ids listed in the folder's ``sweep.json`` when the table has no ``case_id`` column (keyed rows, e.g. the agent
  traces' ``turns.parquet``); else the study's own count at the run's parameters when it exposes one
  (``study.case_count(params)``); else missing;
- **wall minutes**: the manifest's ``run.wall_minutes`` (missing for a notebook that never ran);
- **the primary comparison**: its family's name (``study.primary``) and its words (``study.power.comparison``), and its
  minimal detectable effect at 80 % power, two-sided 5 % (``study.mde``), at the run's parameters
  (:func:`study_parameters`: the notebook's literal defaults, the manifest's parameters over them, mapped onto the
  study's parameters);
- **the ``paper`` preset's MDE**: the same at ``study.params("paper")``, the size a default that cannot decide its
  primary defers to (issue 40: a size the suite cannot hold within 3 hours is the ``paper`` preset's);
- **the verdict**: the ``verdict`` of the primary family's row in the notebook's saved decided tables (the
  :data:`sur_lab.analysis.decisions.COLUMNS` schema, read from ``tables/<NN>_*.csv``: :func:`primary_verdict`);
  :data:`NOT_RUN` for a notebook that never ran, :data:`FAILED` for one that failed, :data:`NOT_SAVED` when no saved
  table holds the primary family's row.

A second folder (``smoke=``, a smoke release) adds its cases, minutes and MDE side by side. The release renders the
table into ``results/README.md`` and prints it (``sur-lab release --sizes [SMOKE_DIR]``;
:func:`sur_lab.runtime.release.sizes_markdown`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from sur_lab.paths import run_tag
from sur_lab.runtime.run_notebooks import effective_parameters, notebooks
from sur_lab.studies import STUDIES
from sur_lab.studies.base import Study

#: The verdict of a notebook that never ran in the folder, of one whose last run failed, and of a finished one whose
#: saved tables hold no row of its primary family.
NOT_RUN = "not run"
FAILED = "failed"
NOT_SAVED = "not in a saved table"
#: :func:`sizes_table`'s columns; the ``smoke_*`` ones only with a second folder.
COLUMNS = ["notebook", "study", "preset", "cases", "wall_minutes", "family", "comparison", "mde", "mde_unit",
           "paper_mde", "verdict"]
SMOKE_COLUMNS = ["smoke_cases", "smoke_minutes", "smoke_mde"]


def notebook_studies() -> dict[str, Study]:
    """``{notebook stem: study}`` of every registered study (:data:`sur_lab.studies.STUDIES`), in notebook order."""
    found = {STUDIES[name].notebook: STUDIES[name] for name in STUDIES}
    return dict(sorted(found.items()))


def _entry(manifest: Mapping[str, Any], stem: str) -> dict[str, Any]:
    entry = (manifest.get("notebooks") or {}).get(stem)
    return entry if isinstance(entry, dict) else {}


def study_parameters(study: Study, notebook: Path, parameters: Mapping[str, Any], preset: str | None = None
                     ) -> dict[str, Any]:
    """The study's parameters of a run of ``notebook`` with ``parameters`` (a manifest entry's): the notebook's
    effective parameters (:func:`run_values`) that the study declares, over ``study.params(preset)`` of the run's
    preset (``None`` values keep the preset's, as in the notebooks' ``STUDY.params(preset, ...)`` call).

    Raises:
        ValueError: naming the preset when the study does not define it (:meth:`sur_lab.studies.base.Study.params`).
    """
    values = run_values(notebook, parameters, preset)
    declared = study.params(values["preset"])
    return study.params(values["preset"], **{k: v for k, v in values.items() if k in declared})


def run_values(notebook: Path, parameters: Mapping[str, Any], preset: str | None = None) -> dict[str, Any]:
    """The values a run of ``notebook`` with ``parameters`` sees (:func:`sur_lab.runtime.run_notebooks.
    effective_parameters`), with ``"preset"`` set: the one ``parameters`` pass, else ``preset`` (the manifest's),
    else the notebook's own default, else ``"default"``."""
    values = effective_parameters(notebook, {**({"preset": preset} if preset else {}), **dict(parameters)})
    values["preset"] = values.get("preset") or "default"
    return values


def _listed(entry: Mapping[str, Any]) -> set[str] | None:
    """The outputs a manifest entry lists (``None``: no entry, so every file of the folder counts; an empty set for a
    notebook that never ran)."""
    if not entry:
        return None
    if entry.get("status", "missing") == "missing":
        return set()
    return set(entry.get("outputs") or {}) or None


def folder_stem(study: Study, params: Mapping[str, Any], values: Mapping[str, Any]) -> str | None:
    """The name a run's sweep folder starts with: the study's prefix and its folder tag
    (:meth:`sur_lab.studies.base.Study.folder_tag` of ``params`` and the run's ``seed``, ``eval_batch`` and
    ``executor`` among ``values``), before the model's part (:func:`sur_lab.sweeps.sweep_folder`); ``None`` when the
    tag cannot be built from them."""
    try:
        tag = study.folder_tag(params, seed=values.get("seed", 0), eval_batch=values.get("eval_batch"),
                               executor=values.get("executor"))
    except (KeyError, TypeError, ValueError):
        return None
    return f"{study.folder_prefix}_{run_tag(**tag)}"


def sweep_folders(results: Path, study: Study, entry: Mapping[str, Any] | None = None,
                  stem: str | None = None) -> list[Path]:
    """The study's own sweep folders in ``results/sweeps``: named ``<folder_prefix>_<first folder key>-...``
    (``02_niah_ctx-...``, not ``02_niah_matched_...``), not a side folder beside another (``<folder>_late``), and,
    when the manifest ``entry`` lists the notebook's outputs, holding a listed file; of those, the ones named
    ``<stem>_...`` (:func:`folder_stem`: the run's own parameters) when ``stem`` is given and any is. Sorted;
    usually one."""
    root = Path(results) / "sweeps"
    if not root.is_dir():
        return []
    head = f"{study.folder_prefix}_{next(iter(study.folder_keys))}-"
    found = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(head))
    listed = _listed(entry or {})
    if listed is not None:
        found = [p for p in found if any(o.startswith(f"sweeps/{p.name}/") for o in listed)]
    found = [p for p in found if not any(p.name.startswith(q.name + "_") for q in found if q != p)]
    own = [p for p in found if stem and p.name.startswith(stem + "_")]
    return own or found


def case_count(results: Path, study: Study, entry: Mapping[str, Any] | None = None,
               params: Mapping[str, Any] | None = None, stem: str | None = None) -> int | None:
    """The number of distinct cases the study's run holds in ``results`` (module docstring: its records' ``case_id``
    values, else its ``sweep.json`` case list, else ``study.case_count(params)`` when the study has one), in its
    folder (:func:`sweep_folders`, narrowed by ``stem``); ``None`` when none of these is there, or when several of the
    study's folders remain (which run to count would be a guess)."""
    folders = sweep_folders(results, study, entry, stem)
    if len(folders) == 1:
        table = folders[0] / study.table_file
        if table.is_file() and "case_id" in pq.read_schema(table).names:
            return int(pd.read_parquet(table, columns=["case_id"])["case_id"].nunique())
        manifest = folders[0] / "sweep.json"
        if manifest.is_file():
            cases = json.loads(manifest.read_text(encoding="utf-8")).get("cases")
            if isinstance(cases, list):
                return len(set(map(str, cases)))
    if not folders and params is not None and callable(getattr(study, "case_count", None)):
        return int(study.case_count(params))
    return None


def _decided_tables(results: Path, stem: str, entry: Mapping[str, Any]) -> list[Path]:
    folder = Path(results) / "tables"
    if not folder.is_dir():
        return []
    found = sorted(p for p in folder.glob(f"{stem[:3]}*.csv") if p.is_file())
    listed = _listed(entry)
    if listed is not None:
        found = [p for p in found if f"tables/{p.name}" in listed]
    return [p for p in found if {"family", "verdict"} <= set(pd.read_csv(p, nrows=0).columns)]


def primary_verdict(results: Path, study: Study, entry: Mapping[str, Any]) -> tuple[str, str]:
    """``(comparison, verdict)`` of the study's primary comparison in ``results``: the row of ``study.primary``'s
    family in the notebook's saved decided tables (``tables/<NN>_*.csv`` with ``family`` and ``verdict`` columns,
    those the manifest ``entry`` lists); several rows that differ are joined with ``"; "``. ``("", NOT_RUN)`` for a
    notebook that never ran, ``("", FAILED)`` for a failed one, ``("", NOT_SAVED)`` when no table holds the row."""
    status = entry.get("status", "missing")
    if status != "finished":
        return "", FAILED if status == "failed" else NOT_RUN
    stem = study.notebook
    rows = []
    for path in _decided_tables(results, stem, entry):
        df = pd.read_csv(path)
        df = df[df["family"] == study.primary.name]
        for r in df.itertuples(index=False):
            pair = (str(getattr(r, "comparison", "")), str(r.verdict))
            if pair not in rows:
                rows.append(pair)
    if not rows:
        return "", NOT_SAVED
    return "; ".join(c for c, _ in rows), "; ".join(v for _, v in rows)


def _minutes(entry: Mapping[str, Any]) -> float:
    value = (entry.get("run") or {}).get("wall_minutes")
    return float(value) if value is not None else math.nan


def _facts(results: Path, manifest: Mapping[str, Any], study: Study, path: Path) -> dict[str, Any]:
    """One folder's facts of one study: preset, params, cases, minutes, MDE."""
    entry = _entry(manifest, path.stem)
    preset = entry.get("preset") or manifest.get("preset") or None
    params = study_parameters(study, path, entry.get("parameters") or {}, preset)
    effect, unit = study.mde(params)
    values = run_values(path, entry.get("parameters") or {}, preset)
    stem = folder_stem(study, params, values)
    return {"entry": entry, "preset": values["preset"], "params": params,
            "cases": case_count(results, study, entry, params, stem), "minutes": _minutes(entry),
            "mde": float(effect), "unit": unit}


def sizes_table(results: Path, manifest: Mapping[str, Any], *, smoke: Path | None = None,
                smoke_manifest: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """What each study's run cost and what it can decide: one row per notebook (in ``notebooks/``) that has a study.

    Args:
        results: the release folder.
        manifest: its manifest (:func:`sur_lab.runtime.release.read_manifest`).
        smoke: a second release folder (a smoke release) whose cases, minutes and MDE come side by side.
        smoke_manifest: its manifest (required with ``smoke``).

    Returns:
        A DataFrame with :data:`COLUMNS` (``cases`` an ``Int64`` with missing values, ``wall_minutes``, ``mde`` and
        ``paper_mde`` float64 with NaN for missing and for a size that cannot reach 80 % power, ``mde_unit`` e.g.
        ``"pp"``, ``"x"``, ``"nats"``) and, with ``smoke``, :data:`SMOKE_COLUMNS` (the same quantities in that folder;
        ``smoke_mde`` in ``mde_unit``).

    Raises:
        ValueError: naming ``smoke_manifest`` when ``smoke`` is given without it; as :func:`study_parameters`.
    """
    if smoke is not None and smoke_manifest is None:
        raise ValueError("smoke_manifest: required with smoke (the second folder's manifest.json)")
    paths = {p.stem: p for p in notebooks("*")}
    rows = []
    for stem, study in notebook_studies().items():
        if stem not in paths:
            continue
        main = _facts(Path(results), manifest, study, paths[stem])
        _, verdict = primary_verdict(Path(results), study, main["entry"])
        paper, _ = study.mde(study.params("paper")) if "paper" in study.presets else (math.nan, "")
        row = {"notebook": stem, "study": study.name, "preset": main["preset"], "cases": main["cases"],
               "wall_minutes": main["minutes"], "family": study.primary.name, "comparison": study.power.comparison,
               "mde": main["mde"], "mde_unit": main["unit"], "paper_mde": float(paper), "verdict": verdict}
        if smoke is not None:
            other = _facts(Path(smoke), smoke_manifest, study, paths[stem])
            row.update(smoke_cases=other["cases"], smoke_minutes=other["minutes"], smoke_mde=other["mde"])
        rows.append(row)
    columns = COLUMNS + (SMOKE_COLUMNS if smoke is not None else [])
    table = pd.DataFrame(rows, columns=columns)
    for col in ("cases", "smoke_cases"):
        if col in table:
            table[col] = table[col].astype("Int64")
    for col in ("wall_minutes", "mde", "paper_mde", "smoke_minutes", "smoke_mde"):
        if col in table:
            table[col] = table[col].astype("float64")
    return table


__all__ = ["COLUMNS", "FAILED", "NOT_RUN", "NOT_SAVED", "SMOKE_COLUMNS", "case_count", "folder_stem",
           "notebook_studies", "primary_verdict", "run_values", "sizes_table", "study_parameters", "sweep_folders"]
