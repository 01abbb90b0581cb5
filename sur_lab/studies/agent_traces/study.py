"""Notebook 10's study: :data:`STUDY`, the :class:`~sur_lab.studies.base.Study` (:class:`AgentTracesStudy`)
declaring its name and folder, :data:`PRESETS` (sizes), :data:`FIXED` (the other parameters' defaults), the parameters'
checks (:func:`check_params`), its cases (traces), methods (paths), families and power (:data:`POWER`), its report,
and the run that stores each finished trace's rows at once (:meth:`AgentTracesStudy.run`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from sur_lab.analysis.decisions import PowerBasis, PowerDesign
from sur_lab.executors import get_executor
from sur_lab.fingerprint import digest
from sur_lab.studies.agent_traces.cases import _check_datasets, build_traces
from sur_lab.studies.agent_traces.design import AGREEMENT_FAMILY, KIND_FAMILY, PRIMARY, REGION_FAMILY
from sur_lab.studies.agent_traces.report import conclusion, kind_table, primary_table, region_table, summary_table
from sur_lab.studies.agent_traces.run import TracePath, _fingerprint, add_cumulative, default_paths, run_trace
from sur_lab.studies.base import Report, Study
from sur_lab.sweeps.store import SweepStore

__all__ = ["NAME", "NOTEBOOK", "FOLDER", "TABLE_FILE", "PRESETS", "FIXED", "PRIMARY_POWER", "POWER", "check_params",
           "AgentTracesStudy", "STUDY"]

#: The study's name in the registry (``sur-lab sweep agent-traces``), its notebook, and its sweep folders' prefix.
NAME = "agent-traces"
NOTEBOOK = "10_agent_traces"
FOLDER = "10_agent_traces"
#: The study's own per-turn table in its folder (not ``records.parquet``: a turn is not a one-edit sweep record).
TABLE_FILE = "turns.parquet"
#: Study sizes by preset (:func:`sur_lab.studies.presets.study_params`). ``default`` runs the Qwen study model
#: (notebook 10's ``model_name``): 6 traces (two per dataset) of 6 turns, 30 later turns of which 24 ask a reaching
#: question, passages capped at 96 tokens (issue 40: at 16 tokens the gold span was in the turn's own output in 19 of
#: 57 turns, at 96 in 49), prompts of about 300 to 1,500 tokens, about 1.2e5 tokens forwarded over all paths (counted
#: from the traces' token diffs: as many as the earlier 12 traces of 6 turns at a 16-token cap, notebook 10's share of
#: the suite on 2 cores). Six traces are the fewest whose clustered sign-flip test can decide the primary (six traces
#: that all gain: p = 2/64). ``paper``: 48 traces of 8 turns (split by the dev pools' capacity, :func:`split_traces`),
#: 288 reaching turns: the size at which the agreement margin can be decided. The measured time is in the issue note
#: and on the results page.
PRESETS = {
    "smoke": {"n_traces": 1, "turns": 4, "max_doc_tokens": 48, "max_new_tokens": 8},
    "default": {"n_traces": 6, "turns": 6, "max_doc_tokens": 96, "max_new_tokens": 12},
    "paper": {"n_traces": 48, "turns": 8, "max_doc_tokens": 96, "max_new_tokens": 16},
}
#: The other parameters at their defaults (the literals of notebook 10's ``parameters`` cell).
FIXED = {"datasets": ["hotpotqa", "2wikimultihopqa", "musique"], "budgets": [2, 5, 10], "executor": "packed"}
#: The power statement's basis (issue 40; :data:`POWER`): a planning value, not a measurement. The SD over traces of a
#: trace's mean log TTFT ratio (prefix reuse over sync, turns after the first) is taken as 0.2 (a trace's speed-up
#: within about ±20 %), for CPU timings on a shared 2-core machine; a measured default run replaces it.
PRIMARY_POWER = PowerBasis(0.2, "a planning value (no published spread): 0.2 per trace, timings on a shared CPU",
                           unit="x")


def check_params(p: Mapping[str, Any]) -> None:
    """Refuse bad parameters before any model call (``sur-lab sweep`` calls it: the study's paths are not sweep
    methods).

    Raises:
        ValueError: naming ``budgets`` (empty or outside (0, 100]), ``n_traces`` (< 1), ``turns`` (< 2),
            ``max_doc_tokens`` (< 8), ``max_new_tokens`` (< 1), ``datasets`` (empty, or outside
            :data:`TRACE_DATASETS`) or ``executor`` (unknown).
    """
    default_paths(p["budgets"])
    for name, low in (("n_traces", 1), ("turns", 2), ("max_doc_tokens", 8), ("max_new_tokens", 1)):
        if isinstance(p[name], bool) or not isinstance(p[name], int) or p[name] < low:
            raise ValueError(f"{name}={p[name]!r} must be an integer >= {low}")
    _check_datasets(p["datasets"])
    get_executor(p["executor"])


#: The primary comparison's power design (issue 40): the study's ``mde`` and ``power_line`` (the
#: :class:`~sur_lab.studies.base.Study` base's) at its parameters.
POWER = PowerDesign("the lead sync path vs prefix reuse, TTFT", PRIMARY, PRIMARY_POWER, lambda p: p["n_traces"],
                    what="traces")


class AgentTracesStudy(Study):
    """Agent traces (notebook 10): whole agent prompts synced against prefix reuse. Its cases are traces
    (:func:`build_traces`), not :class:`sur_lab.sweeps.Case` objects (each path's turn depends on its own earlier
    turns), its methods are :class:`TracePath` objects, and its records are per-(trace, turn, path) rows in
    :data:`TABLE_FILE` (:meth:`run`). One process, one request at a time: the per-turn TTFT is a per-request latency,
    so Ray workers are refused; ``eval_batch`` is accepted for the study API and ignored (the query forward is per
    request; a turn's answers are decoded together, :func:`run_trace`)."""

    name, notebook, folder_prefix = NAME, NOTEBOOK, FOLDER
    presets, fixed = PRESETS, FIXED
    folder_keys = {"data": "datasets", "tr": "n_traces", "turns": "turns", "cap": "max_doc_tokens", "b": "budgets",
                   "tok": "max_new_tokens", "ex": "executor", "seed": "seed"}
    power, families = POWER, (PRIMARY, AGREEMENT_FAMILY, KIND_FAMILY, REGION_FAMILY)
    table_file = TABLE_FILE
    distributed = False

    def check(self, p: Mapping[str, Any]) -> None:
        """:func:`check_params` (the study's paths are not sweep methods)."""
        check_params(p)

    def cases(self, tokenizer, p: Mapping[str, Any], seed: int = 0) -> list[dict]:
        """The study's traces (:func:`build_traces`), one per case."""
        return build_traces(tokenizer, p, seed=seed)

    def methods(self, p: Mapping[str, Any]) -> list[TracePath]:
        """The study's paths: :func:`default_paths` ``(p["budgets"])``."""
        return default_paths(p["budgets"])

    def report(self, runs: pd.DataFrame, p: Mapping[str, Any], *, decide: bool = True) -> Report:
        """The per-turn summary (:func:`summary_table`), the region and question-kind tables (:func:`region_table`,
        :func:`kind_table`), the declared comparisons decided (``"decided"``: :func:`primary_table`, the primary
        first) and the conclusion lines (:func:`conclusion`), all on the 5 % sync path when it ran, else the first
        budget's."""
        budgets = p["budgets"]
        lead = f"sync {5 if 5 in budgets else budgets[0]:g}%"
        summary, regions, kinds = summary_table(runs), region_table(runs), kind_table(runs)
        decided = primary_table(runs, sync=lead, decide=decide)
        return Report(tables={"summary": summary, "regions": regions, "kinds": kinds, "decided": decided},
                      conclusion=conclusion(regions, summary, runs, sync=lead, kinds=kinds, decide=decide,
                                            decided=decided))

    def run(self, lm, traces: Sequence[dict], p: Mapping[str, Any], where: Path, *, seed: int = 0,
            executor: str = "packed", threads: int | None = None, progress: bool = True, **_: Any) -> pd.DataFrame:
        """Run the traces, resuming finished ones, through :meth:`sur_lab.sweeps.SweepStore.run_keyed`: one case per
        trace keyed by ``(turn, path)``. Each finished trace's rows are written at once (atomically) to
        ``parts/<trace>.jsonl``, so an interrupted run loses at most the trace in flight and the next call resumes
        after it; the fingerprint (model, parameters, seed, executor, versions, and a digest of the trace) is checked
        on read, and a trace stored with another is refused. The folder is locked for the call. (Folders written
        before this store held ``parts/*.parquet`` and ``study.json``; they are not read back: such a run is
        recomputed.)

        Returns:
            The per-(trace, turn, path) table (:func:`run_traces` columns, plus ``model``, ``seed`` and the ``threads``
            each trace ran with); the folder holds :data:`TABLE_FILE`, ``traces.json``, ``sweep.json`` and ``parts/``.

        Raises:
            ValueError: naming the folder, the trace and the first differing field when a stored trace was made with
                another fingerprint.
            RuntimeError: when another process is running a sweep in the same folder.
        """
        paths = self.methods(p)
        if threads:
            torch.set_num_threads(threads)

        def compute(trace: Mapping[str, Any]) -> list[dict]:
            rows = run_trace(lm, trace, paths, executor=executor, max_new_tokens=p["max_new_tokens"], seed=seed)
            return [{**row, "model": lm.spec.name, "seed": seed, "threads": torch.get_num_threads()} for row in rows]

        store = SweepStore(where)
        runs = store.run_keyed({trace["id"]: trace for trace in traces}, compute, key=("turn", "path"),
                               fingerprint=_fingerprint(lm, p, seed, executor),
                               case_fingerprint=lambda trace: {"trace": digest({"trace": trace})}, table=TABLE_FILE,
                               finish=add_cumulative, progress=progress, desc="traces")
        store.write_json("traces.json", traces)
        return runs


STUDY = AgentTracesStudy()
