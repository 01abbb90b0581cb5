"""The evidence-location study (``sur-lab sweep evidence-location``, notebook 08) on the
:class:`~sur_lab.studies.base.Study` base: its presets, declared families and power design, the fixed-slot refresh as a
sweep method, and the panel file its sweep writes beside the records (:data:`PANEL_FILE`, read back by
:func:`sur_lab.studies.evidence_location.pooled.combine`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from sur_lab.analysis.decisions import ALPHA, COLUMNS, DIFF_COLUMNS, Family, PowerBasis, PowerDesign, sd_from_interval
from sur_lab.edits import EditedContext
from sur_lab.paths import atomic_path
from sur_lab.repair import repair
from sur_lab.studies.base import Report, Study
from sur_lab.studies.evidence_location.cases import (
    FIXED_SLOT_METHOD,
    Panel,
    build_panel,
    panel_tokenizers,
    sweep_cases_of,
)
from sur_lab.studies.evidence_location.report import (
    COMPLETE_REPLAY,
    FIXED_SLOT_LABEL,
    NLL_SIDE_MARGIN,
    factorial_table,
    findings,
    nll_side_decision,
    results_table,
    slot_gap_table,
    table16,
)
from sur_lab.studies.evidence_location.sources import Geometry, _geometries
from sur_lab.sweeps import make_scorer

__all__ = ["PRESETS", "NAME", "NOTEBOOK", "FOLDER", "FIXED", "PRIMARY_FAMILY", "PRIMARY_POWER",
           "PAPER_FEASIBLE_SHARE", "SECONDARY", "FIXED_SLOT_FAMILY", "FixedSlotRefresh", "POWER", "decided_table",
           "EvidenceLocationStudy", "STUDY", "PANEL_FILE", "ANALYSIS_PARAMS", "FEASIBLE", "EXCLUDED", "NOT_EXAMINED",
           "panel_record", "write_panel_file", "read_panel_file"]

#: Study sizes (``sur_lab.studies.presets.resolve_preset``). ``candidates_per_dataset``: the fixed candidate pool drawn
#: per dataset from the natural-QA eligible sources (``None`` = all of them, in draw order); ``sources_per_dataset``:
#: stop after this many feasible sources per dataset (``None`` = every feasible candidate). Methods: the references,
#: the fixed-slot refresh (:data:`FIXED_SLOT_METHOD` at the exact allowance W) and the allocators at ``budgets`` (%).
#: ``smoke`` runs SmolLM2 on 2 sources at the one small ``smoke`` geometry, ``default`` the Qwen study model on 24 sources (issue 25's floor; quarter
#: geometry; the suite fans notebook 08 out over two Ray workers, its ``suite_parameters``; its quiet 2-core time is
#: not measured yet, and issue 25's note estimates it above the 30-minute share), ``paper`` the 400-candidate pool of natural QA with the
#: paper's geometry (275 feasible in the paper).
PRESETS = {
    "smoke": {"datasets": ["hotpotqa", "2wikimultihopqa"], "candidates_per_dataset": 100, "sources_per_dataset": 1,
              "geometry": "smoke", "references": ["Shift", "Replay", "Re-prefill"], "fixed_slot": True,
              "allocators": ["SUR"], "budgets": [5], "max_new_tokens": 4, "n_boot": 200},
    "default": {"datasets": ["2wikimultihopqa", "hotpotqa", "iirc", "musique"], "candidates_per_dataset": None,
                "sources_per_dataset": 6, "geometry": "quarter", "references": ["Shift", "Replay", "Re-prefill"],
                "fixed_slot": True, "allocators": ["SUR"], "budgets": [2, 5], "max_new_tokens": 16,
                "n_boot": 10_000},
    "paper": {"datasets": ["2wikimultihopqa", "hotpotqa", "iirc", "musique"], "candidates_per_dataset": 100,
              "sources_per_dataset": None, "geometry": "paper", "references": ["Shift", "Replay", "Re-prefill"],
              "fixed_slot": True,
              "allocators": ["SUR", "BM25 (same units)", "CacheBlend-Adapted", "InfoFlow-Motivated",
                             "ProphetKV-Adapted"],
              "budgets": [2, 5], "max_new_tokens": 64, "n_boot": 10_000},
}

NAME = "evidence-location"
NOTEBOOK = "08_evidence_location"
FOLDER = "08_evidence_location"
#: Parameters that are not preset sizes, at the notebook's defaults (the literals of its ``parameters`` cell).
FIXED = {"boot_seed": 20260928, "panel_models": []}
#: The declared families of notebook 08's findings (issue 36; :mod:`sur_lab.analysis.decisions`): the preregistered
#: primary tested alone with its margin, the secondary family with Holm
#: (:func:`~sur_lab.studies.evidence_location.report.table15`), and the fixed slot's side effects on the Table 16
#: fidelity endpoints with Holm.
PRIMARY_FAMILY = Family("primary: NLL side (preregistered)", "continuous",
                        "complete replay's gold-NLL side contrast (Eq. 10), sources resampled; a null result needs "
                        "equivalence within the margin", primary=True, margin=NLL_SIDE_MARGIN)
#: The power statement's basis (issue 40; :data:`POWER`): the SD of one source's NLL side contrast, from the paper's
#: Table 15 interval (-0.039 nats, -0.099 to 0.021, over 275 sources with three models averaged per source;
#: :func:`~sur_lab.analysis.decisions.sd_from_interval`). One model's per-source contrast varies more, so the stated
#: MDE of a one-model run errs small.
PRIMARY_POWER = PowerBasis(sd_from_interval(-0.099, 0.021, 275),
                           "the paper's Table 15 NLL side interval, -0.099 to 0.021 nats over 275 sources",
                           unit="nats")
#: Sources a preset without ``sources_per_dataset`` yields, per candidate: the paper's 275 feasible of 400 (appendix
#: 10.1), for the power statement only (the run counts its own).
PAPER_FEASIBLE_SHARE = 275 / 400
SECONDARY = Family("secondary (Holm)", "continuous",
                   "complete replay's NLL tail and interaction and EM side, tail and interaction (appendix 10.2)")
FIXED_SLOT_FAMILY = Family("the fixed slot's side effects", "continuous",
                           "the fixed-slot refresh's side contrast on each Table 16 fidelity endpoint but the gold NLL")


@dataclass(frozen=True)
class FixedSlotRefresh:
    """The fixed-slot refresh as a sweep method (:class:`sur_lab.sweeps.Method`): :data:`FIXED_SLOT_METHOD` at the
    exact allowance B = W, i.e. suffix positions ``[0, W)``, the downstream exchange slot (appendix 10.3).

    W is read from the case's edit: the candidate geometry whose edit index p, deletion d and one of whose suffix
    lengths match the edit (the candidates of a list have distinct p, so exactly one does). The same interval and
    token count are refreshed whichever bundle the slot holds. Records carry ``budget_pct`` NaN and
    ``allowance`` = W.

    Attributes:
        geometries: the candidate list the cases were built from.
        name: the record's ``method``; budget_pct: NaN (an exact allowance); protocol: ``"forward"``.
    """

    geometries: tuple[Geometry, ...]
    name: str = FIXED_SLOT_LABEL
    budget_pct: float = float("nan")
    protocol: str = "forward"

    def slot_width(self, edit: EditedContext) -> int:
        """W of the geometry ``edit`` was built at.

        Raises:
            ValueError: naming ``edit`` when no candidate geometry (or more than one slot width) matches its p, d, S.
        """
        widths = {g.slot_width for g in self.geometries
                  if g.edit_index == edit.prefix_len and g.deletion == edit.deleted_len
                  and edit.suffix_len in (g.short_suffix, g.long_suffix)}
        if len(widths) != 1:
            raise ValueError(f"edit (p={edit.prefix_len}, d={edit.deleted_len}, S={edit.suffix_len}) matches "
                             f"{len(widths)} slot widths of the candidate geometries; it is not an evidence-location "
                             "cell of this list")
        return widths.pop()

    def repair(self, lm, prepared, *, executor: str, seed: int, options=None):
        """The edit-local window ``[0, W)`` through the one Algorithm 1 dispatcher (a new cache)."""
        return repair(lm, prepared, FIXED_SLOT_METHOD, None, executor=executor, seed=seed,
                      options=dict(options) if options else None, allowance=self.slot_width(prepared.edit))


def _power_sources(p: Mapping[str, Any]) -> int:
    """The sources of the power statement: ``sources_per_dataset`` per dataset, or the paper's feasible share
    (:data:`PAPER_FEASIBLE_SHARE`) of the candidates when every feasible source runs."""
    if p["sources_per_dataset"] is not None:
        return len(p["datasets"]) * int(p["sources_per_dataset"])
    return int(len(p["datasets"]) * (p["candidates_per_dataset"] or 0) * PAPER_FEASIBLE_SHARE)


#: The primary comparison's power design (issue 40): the study's ``mde`` and ``power_line`` (the
#: :class:`~sur_lab.studies.base.Study` base's) at its parameters.
POWER = PowerDesign("complete replay's NLL side contrast vs 0", PRIMARY_FAMILY, PRIMARY_POWER,
                    lambda p: _power_sources(p), what="sources")


def decided_table(t15: pd.DataFrame, *, alpha: float = ALPHA, decide: bool = True) -> pd.DataFrame:
    """The preregistered primary decided, in the paired-difference schema of the studies' decided tables
    (:data:`sur_lab.analysis.decisions.COLUMNS` then :data:`~sur_lab.analysis.decisions.DIFF_COLUMNS`): one row of
    :data:`PRIMARY_FAMILY`, complete replay's NLL side contrast against 0 (nats), its numbers from Table 15's row and
    its verdict :func:`~sur_lab.studies.evidence_location.report.nll_side_decision`'s (the rule the "NLL side contrast
    null" finding words). Notebook 08 saves it as ``08_decided``; the results index reads the primary's verdict from
    it.

    Args:
        t15: :func:`~sur_lab.studies.evidence_location.report.factorial_table`. alpha: the level.
        decide: ``False`` at a plumbing-check size ("not decided").

    Returns:
        One row: ``family`` :data:`PRIMARY_FAMILY`'s name, ``comparison`` :data:`POWER`'s words, ``a`` "Replay",
        ``b`` "0", ``kind`` "continuous", ``adjust`` "none", the estimate with its 95 % and 90 % (TOST) intervals,
        ``p`` = ``p_adj`` (tested alone), ``n`` and ``n_clusters`` (source-model units, sources), the margin (nats),
        ``mde`` NaN (a bootstrap contrast states none), ``verdict``, and ``delta`` ... ``unit`` "nats". NaN numbers
        and "n/a" ("not decided" without ``decide``) when Table 15 has no such row or no source.
    """
    r, verdict = nll_side_decision(t15, alpha=alpha, decide=decide)
    nan = float("nan")

    def num(col: str, default: float = nan) -> float:
        return default if r is None else float(r[col])

    row = {"family": PRIMARY_FAMILY.name, "comparison": POWER.comparison, "a": COMPLETE_REPLAY, "b": "0",
           "kind": PRIMARY_FAMILY.kind, "adjust": PRIMARY_FAMILY.adjust, "estimate": num("estimate"),
           "ci_low": num("ci_low"), "ci_high": num("ci_high"), "tost_low": num("tost_low"),
           "tost_high": num("tost_high"), "p": num("p"), "p_adj": num("p"), "n": int(num("n", 0)),
           "n_clusters": int(num("n_clusters", 0)), "n_discordant": nan, "family_size": 1, "alpha": alpha,
           "margin": NLL_SIDE_MARGIN.value, "margin_source": NLL_SIDE_MARGIN.source, "higher_is_better": True,
           "mde": nan, "verdict": verdict, "delta": num("estimate"), "delta_low": num("ci_low"),
           "delta_high": num("ci_high"), "delta_mde": nan, "unit": "nats"}
    return pd.DataFrame([row], columns=[*COLUMNS, *DIFF_COLUMNS])


class EvidenceLocationStudy(Study):
    """The preregistered evidence-location experiment (notebook 08): every cell x methods x budgets, answers scored by
    the dataset rules (:func:`sur_lab.sweeps.make_scorer`), every record with the endpoints of issue 25. No case is
    timed (the study measures quality and fidelity; answers come from batched passes). Its cases are a
    :class:`Panel` (four cells per feasible source, by tokenization alone); the sweep writes :data:`PANEL_FILE` beside
    the records."""

    name, notebook, folder_prefix = NAME, NOTEBOOK, FOLDER
    presets, fixed = PRESETS, FIXED
    folder_keys = {"data": lambda p: list(p["datasets"]), "cand": "candidates_per_dataset", "n": "sources_per_dataset",
                   "geom": "geometry", "fs": "fixed_slot", "b": "budgets", "tok": "max_new_tokens", "seed": "seed",
                   "eb": "eval_batch"}
    power, families = POWER, (PRIMARY_FAMILY, SECONDARY, FIXED_SLOT_FAMILY)

    def folder_tag(self, p: Mapping[str, Any], **run: Any) -> dict[str, Any]:
        """The base's entries, then ``pm`` (the sorted ``panel_models``) when the panel is a common one."""
        tag = super().folder_tag(p, **run)
        if p.get("panel_models"):
            tag["pm"] = sorted(p["panel_models"])
        return tag

    def cases(self, tokenizer, p: Mapping[str, Any], seed: int = 0) -> Panel:
        """The study's :class:`Panel` (:func:`build_panel`; by tokenization alone, before any model runs). With
        ``panel_models`` (a parameter) every listed model's tokenizer must build a source too: the common panel that
        several models' runs share (:func:`~sur_lab.studies.evidence_location.pooled.combine` pools them).

        Raises:
            ValueError: as :func:`build_panel`.
        """
        return build_panel(tokenizer, p["datasets"], geometries=p["geometry"],
                           candidates_per_dataset=p["candidates_per_dataset"],
                           sources_per_dataset=p["sources_per_dataset"], seed=seed,
                           also=panel_tokenizers(p["panel_models"], tokenizer))

    def sweep_cases(self, panel: Panel, p: Mapping[str, Any]) -> list:
        """Four :class:`sur_lab.sweeps.Case` per feasible source, with their answer targets (:func:`sweep_cases_of`)."""
        return sweep_cases_of(panel.cases)

    def scorer_for(self, panel: Panel):
        """The dataset rules of each cell's example (:func:`sur_lab.sweeps.make_scorer`)."""
        return make_scorer(panel.cases)

    def methods(self, p: Mapping[str, Any]) -> list:
        """The sweep's methods for parameters ``p``: the references, the fixed-slot refresh (when ``p["fixed_slot"]``)
        and the allocators (each at ``p["budgets"]``).

        Raises:
            ValueError: naming ``geometry`` when unknown.
        """
        out: list = list(p["references"])
        if p["fixed_slot"]:
            out.append(FixedSlotRefresh(_geometries(p["geometry"])))
        return out + [a for a in p["allocators"] if a not in out]

    def finish(self, lm, records, panel: Panel, p: Mapping[str, Any], where, *, seed: int = 0, **run: Any):
        """Write :data:`PANEL_FILE` beside the records (:func:`write_panel_file`)."""
        write_panel_file(where, panel, p, seed=seed)
        return records

    def report(self, records: pd.DataFrame, p: Mapping[str, Any], *, decide: bool = True) -> Report:
        """Table 15 (:func:`factorial_table`), Table 16 (:func:`table16`), the replay minus fixed-slot gaps
        (:func:`slot_gap_table`, with the fixed slot) and the findings (:func:`findings`) as conclusion lines.
        ``decide``: ``False`` at a plumbing-check size."""
        table = results_table(records)
        conditions = [COMPLETE_REPLAY] + ([FIXED_SLOT_LABEL] if p["fixed_slot"] else [])
        t15 = factorial_table(table, conditions, n_boot=p["n_boot"], seed=p["boot_seed"])
        t16 = table16(table, conditions, n_boot=p["n_boot"], seed=p["boot_seed"])
        gaps = slot_gap_table(table, n_boot=p["n_boot"], seed=p["boot_seed"]) if p["fixed_slot"] else None
        verdicts = findings(t15, t16, gaps, decide=decide)
        word = {True: "reproduced", False: "not reproduced", None: "undecided"}
        lines = [f"- {r.finding}: {word[r.reproduced]}, {r.verdict} ({r.rule}): {r.evidence}"
                 for r in verdicts.itertuples()]
        return Report(tables={"results": table, "table15": t15, "table16": t16, "gaps": gaps, "findings": verdicts,
                              "decided": decided_table(t15, decide=decide)}, conclusion=lines)


STUDY = EvidenceLocationStudy()


# ---------------------------------------------------------------------------------------------------------------------
# The panel file: the run's candidates and their outcomes, read back across models by pooled.combine (appendix 10.1)

#: The file :meth:`STUDY.sweep` writes into its folder beside ``records.parquet`` (:func:`write_panel_file`): the run's
#: parameters and seed, and the outcome of every candidate it examined, so that
#: :func:`~sur_lab.studies.evidence_location.pooled.combine` can form the common panel of several models' runs.
PANEL_FILE = "panel.json"
#: Parameters that change no record (the analysis's own): pooled runs may differ in them.
ANALYSIS_PARAMS = ("n_boot", "boot_seed")
#: A candidate's outcome for one model's run in :func:`~sur_lab.studies.evidence_location.pooled.common_panel`: built
#: at some candidate geometry.
FEASIBLE = "feasible"
#: ... excluded with its reason (:class:`~sur_lab.studies.evidence_location.sources.Exclusion`).
EXCLUDED = "excluded"
#: ... never examined (the run stopped at its ``sources_per_dataset``-th feasible source before it).
NOT_EXAMINED = "not examined"


def panel_record(built: Panel, p: Mapping[str, Any], *, seed: int) -> dict[str, Any]:
    """What :data:`PANEL_FILE` holds for one run: ``{"study", "params", "seed", "candidates"}``.

    ``params`` are the run's parameters (:meth:`STUDY.params`) minus :data:`ANALYSIS_PARAMS` (``panel_models``
    sorted: the panel does not depend on their order); ``candidates`` maps each
    dataset of ``p["datasets"]`` to ``{"feasible": [source ids], "excluded": [source ids]}``, in draw order: every
    candidate the run examined, with its outcome (decided by tokenization alone, :func:`build_panel`).

    Raises:
        ValueError: naming ``built`` when it holds a dataset outside ``p["datasets"]``.
    """
    datasets = list(p["datasets"])
    extra = sorted({s.example.dataset for s in built.sources} - set(datasets))
    if extra:
        raise ValueError(f"built holds sources of {extra}, not in the parameters' datasets {datasets}")
    return {
        "study": NAME,
        "params": {k: (sorted(v) if k == "panel_models" else v) for k, v in p.items() if k not in ANALYSIS_PARAMS},
        "seed": int(seed),
        "candidates": {d: {FEASIBLE: [s.example.id for s in built.sources if s.example.dataset == d],
                           EXCLUDED: [e.source_id for e in built.exclusions if e.dataset == d]} for d in datasets},
    }


def write_panel_file(folder, built: Panel, p: Mapping[str, Any], *, seed: int) -> None:
    """Write :func:`panel_record` as ``folder/panel.json`` (atomically; the sweep calls it after its records)."""
    path = Path(folder) / PANEL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(panel_record(built, p, seed=seed), indent=1, default=str), encoding="utf-8")


def read_panel_file(folder) -> dict[str, Any]:
    """``folder/panel.json`` (:func:`write_panel_file`).

    Raises:
        FileNotFoundError: naming the file when it is missing (a folder swept before the file existed: rerun the
            notebook or ``sur-lab sweep evidence-location`` with the same parameters, which resumes every record and
            writes it).
        ValueError: naming the file when it is not an evidence-location panel record.
    """
    path = Path(folder) / PANEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: rerun the sweep of {path.parent} with its parameters (it "
                                "resumes every record and writes the panel file)")
    record = json.loads(path.read_text(encoding="utf-8"))
    if (not isinstance(record, dict) or record.get("study") != NAME
            or not {"params", "seed", "candidates"} <= set(record)):
        raise ValueError(f"{path} is not an {NAME} panel file")
    return record
