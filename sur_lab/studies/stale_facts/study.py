"""The stale-facts study (notebook 09 and ``sur-lab sweep stale-facts`` call the same methods): :data:`STUDY`, a
:class:`~sur_lab.studies.base.Study` declaring :data:`PRESETS` (sizes, :mod:`~sur_lab.studies.stale_facts.design`),
:data:`FIXED` (the other parameters' defaults), its cases (:mod:`~sur_lab.studies.stale_facts.construction`), methods,
families and power (:data:`POWER`); the base's :meth:`~sur_lab.studies.base.Study.sweep` returns the records, the sweep
folder (named the same way for both, so each resumes the other's records) and the cases. Its ``finish`` runs the
Erratum placement control in :func:`control_folder` and joins its records relabelled (:func:`late_records`). The
report is :mod:`~sur_lab.studies.stale_facts.report`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from sur_lab.analysis.decisions import PowerDesign
from sur_lab.executors import erratum_templates
from sur_lab.fingerprint import digest
from sur_lab.studies.base import Report, Study
from sur_lab.studies.stale_facts.cases import StaleCase, stale_fact_scorer
from sur_lab.studies.stale_facts.construction import CASE_SIZES, build_stale_cases
from sur_lab.studies.stale_facts.design import (
    EM_FAMILY,
    FAMILIES,
    LATE,
    PLACEMENT_FAMILY,
    PLACEMENT_METHODS,
    PRESETS,
    PRIMARY,
    PRIMARY_BUDGET,
    PRIMARY_POWER,
    STALE_FAMILY,
    STUDY_ALLOCATORS,
    STUDY_REFERENCES,
)
from sur_lab.studies.stale_facts.report import (
    add_stale_endpoints,
    conclusion,
    margin_differences,
    old_margin_differences,
    paired_differences,
    stale_rates,
    summary_table,
)
from sur_lab.sweeps import run_sweep

__all__ = ["NAME", "NOTEBOOK", "FOLDER", "FIXED", "POWER", "StaleFactsStudy", "STUDY", "control_folder",
    "late_records"]


#: The study's name in the registry (``sur-lab sweep stale-facts``), its notebook, and its sweep folders' prefix.
NAME = "stale-facts"
NOTEBOOK = "09_stale_facts"
FOLDER = "09_stale_facts"
#: Parameters that are not preset sizes, at the notebook's defaults (the literals of its ``parameters`` cell):
#: the task families, the reference operators, and the Erratum note's template
#: (:data:`sur_lab.executors.ERRATUM_TEMPLATES`).
FIXED = {"families": list(FAMILIES), "references": list(STUDY_REFERENCES), "erratum_template": "default"}


def _options(p: Mapping[str, Any]) -> dict[str, Any]:
    """The sweep's options: the Erratum template when it is not the default (so default records keep one digest)."""
    return {} if p["erratum_template"] == "default" else {"erratum_template": p["erratum_template"]}


#: The primary comparison's power design (issue 40): the study's ``mde`` and ``power_line`` (the
#: :class:`~sur_lab.studies.base.Study` base's) at its parameters.
POWER = PowerDesign(f"SUR {PRIMARY_BUDGET:g}% vs Shift on EM", PRIMARY, PRIMARY_POWER, lambda p: p["num_cases"])


class StaleFactsStudy(Study):
    """Stale facts (notebook 09): every case x (references + allocators x budgets), scored by
    :func:`stale_fact_scorer` (EM), with ``gold_margin`` and ``old_margin`` in every record
    (:func:`sur_lab.sweeps.run_case`). When Erratum is a reference, every replacement case's placement control
    (:meth:`StaleCase.control_case`) also runs :data:`PLACEMENT_METHODS`, in :func:`control_folder`; those records
    join the others relabelled by :func:`late_records` (``"Shift (late)"``, ``"Re-prefill (late)"``), and every record
    gets :func:`add_stale_endpoints` columns. This study has no latency endpoint: its answers are never timed."""

    name, notebook, folder_prefix = NAME, NOTEBOOK, FOLDER
    presets, fixed = PRESETS, FIXED
    folder_keys = {"ctx": "context_lens", "n": "num_cases", "b": "budgets", "tok": "max_new_tokens", "seed": "seed",
                   "eb": "eval_batch", "r": lambda p: _roster_digest(p)}
    scorer = staticmethod(stale_fact_scorer)
    power, families = POWER, (PRIMARY, EM_FAMILY, STALE_FAMILY, PLACEMENT_FAMILY)

    def methods(self, p: Mapping[str, Any]) -> list[str]:
        """The sweep's methods for parameters ``p``: the references, then the allocators in :data:`STUDY_ALLOCATORS`
        order (others after, in the given order)."""
        allocators = list(p["allocators"])
        ordered = [a for a in STUDY_ALLOCATORS if a in allocators] + [a for a in allocators
                                                                      if a not in STUDY_ALLOCATORS]
        return list(p["references"]) + ordered

    def check(self, p: Mapping[str, Any]) -> None:
        """The base's checks, and the Erratum template (:func:`sur_lab.executors.erratum_templates`)."""
        erratum_templates(p["erratum_template"])
        super().check(p)

    def cases(self, tokenizer, p: Mapping[str, Any], seed: int = 0, *,
              corpus: Sequence[Any] | None = None) -> list[StaleCase]:
        """The study's :class:`StaleCase` roster (:func:`stale_cases`: only the case sizes and ``families`` shape it;
        ``corpus``: filler paragraphs, default :func:`sur_lab.data.qa.load_corpus`). Each gives its sweep case by
        :meth:`StaleCase.sweep_case` (gold ``(gold,)``, meta with ``gold_token``, so each record carries
        ``gold_margin``).

        Raises:
            ValueError: as :func:`build_stale_cases`.
        """
        return build_stale_cases(tokenizer, seed=seed, corpus=corpus, families=tuple(p["families"]),
                                 **{k: p[k] for k in CASE_SIZES})

    def options(self, p: Mapping[str, Any]) -> dict[str, Any]:
        """The Erratum template when it is not the default (so default records keep one digest)."""
        return _options(p)

    def finish(self, lm, records: pd.DataFrame, cases: Sequence[StaleCase], p: Mapping[str, Any], where: Path,
               **run: Any) -> pd.DataFrame:
        """The placement control's records (when Erratum is a reference) joined, then :func:`add_stale_endpoints`."""
        controls = [c.control_case() for c in cases if c.control_edit is not None]
        if "Erratum" in p["references"] and controls:
            late = run_sweep(lm, controls, list(PLACEMENT_METHODS), p["budgets"], control_folder(where),
                             max_new_tokens=p["max_new_tokens"], scorer=stale_fact_scorer, **run)
            records = pd.concat([records, late_records(late)], ignore_index=True)
        return add_stale_endpoints(records)

    def report(self, records: pd.DataFrame, p: Mapping[str, Any], *, decide: bool = True,
               n_boot: int = 10_000) -> Report:
        """The summary (:func:`summary_table`), the declared paired differences (:func:`paired_differences`), the
        stale rates (:func:`stale_rates`), the old-value pulls (:func:`old_margin_differences`), the margin
        differences (:func:`margin_differences`) and the generated conclusion (:func:`conclusion`)."""
        summary = summary_table(records)
        diffs = paired_differences(records, n_boot=n_boot, decide=decide)
        rates = stale_rates(records, decide=decide)
        pulls = old_margin_differences(records, n_boot=n_boot)
        margins = margin_differences(records, n_boot=n_boot)
        model = ", ".join(str(m) for m in records["model"].unique()) if "model" in records else "the model"
        lines = conclusion(summary, diffs, model=model, n_cases=records["case_id"].nunique(), records=records,
                           margins=margins, decide=decide, rates=rates, pulls=pulls)
        return Report(tables={"summary": summary, "paired": diffs, "stale_rates": rates, "old_margin": pulls,
                              "margins": margins}, conclusion=lines)


def _roster_digest(p: Mapping[str, Any]) -> str:
    """The roster's shape as a short digest (the folder's ``r`` entry)."""
    return digest({k: p[k] for k in ("edit_depths", "distances", "num_keys", "families", "erratum_template")})[:8]


STUDY = StaleFactsStudy()


def control_folder(where: Path) -> Path:
    """The sweep folder of the Erratum placement control beside the study's folder ``where`` (``{name}_late``)."""
    where = Path(where)
    return where.with_name(where.name + "_late")


def late_records(records: pd.DataFrame) -> pd.DataFrame:
    """Placement-control records (:meth:`StaleCase.control_case`) relabelled to pair with the study's arms: the
    method gets :data:`LATE` appended (``"Shift (late)"``) and ``case_id`` loses its ``-late`` suffix (a new
    DataFrame)."""
    return records.assign(method=records["method"] + LATE,
                          case_id=records["case_id"].str.removesuffix("-late"))
