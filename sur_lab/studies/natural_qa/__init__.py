"""Natural multi-hop QA: placement cases, the quality–latency tables and the paired statistics (section 4.3).

Construction (section 4.3; appendix 7.5). Each *source* question supplies one non-supporting passage ``X`` that is
inserted before, between or after the supporting evidence of an otherwise fixed *clean document*; deleting ``X``
restores that clean document token for token, so the three placement cases of a source share the clean prompt, the
query and the gold answer and differ only in where the stale suffix starts. Placements are paired by source and are
not independent questions (appendix 8.3).

Modules:

* :mod:`~sur_lab.studies.natural_qa.cases`: the construction and the choices the paper leaves open (sources by
  :func:`select_panel`, placement cases by :func:`build_cases`, Table 20's inputs :func:`qa_inputs`), the sweep cases
  and their timed subset (:func:`sweep_cases`, :func:`timed_case_ids`) and the runnable methods
  (:func:`available_methods`).
* :mod:`~sur_lab.studies.natural_qa.study`: the study (notebook 03 and ``sur-lab sweep natural-qa`` call the same
  methods): :data:`STUDY`, a :class:`~sur_lab.studies.base.Study` declaring :data:`PRESETS`, :data:`FIXED`, its
  placement cases (:meth:`~sur_lab.studies.natural_qa.study.NaturalQAStudy.cases`), methods, timed cases and scorer;
  ``params``, ``folder`` and ``sweep`` are the base's. The declared families (:data:`PRIMARY`,
  :data:`REFERENCE_FAMILY`, :data:`RIVALS`, :data:`LATENCY`), the power design :data:`POWER` and
  :func:`decide_families`; the latency design (Eq. 20).
* :mod:`~sur_lab.studies.natural_qa.report`: the report functions (:func:`results_table`,
  :func:`quality_latency_table`, :func:`dataset_em_table`, :func:`paired_difference_table`,
  :func:`transition_table`, the figures) and notebook 03's conclusion lines.

Every name is importable from this package as before the split (``from sur_lab.studies.natural_qa import ...``).
"""

from sur_lab.studies.natural_qa.cases import (
    DATASET_LABELS,
    PAPER_ALLOCATORS,
    PLACEMENTS,
    QA_DATASETS,
    REFERENCES,
    PlacementCase,
    Source,
    available_methods,
    build_case,
    build_cases,
    choose_passages,
    clean_prompt_ids,
    passage_admissible,
    qa_inputs,
    select_panel,
    sweep_cases,
    timed_case_ids,
    trial_case_id,
)
from sur_lab.studies.natural_qa.report import (
    CASE_KEYS,
    LATENCY_PARTS,
    aggregate_trials,
    conclusion,
    condition_label,
    condition_lines,
    dataset_em_table,
    dataset_lines,
    latency_breakdown,
    lead_of,
    paired_difference_table,
    panel_table,
    plot_figure4,
    plot_quality_latency,
    plot_transitions,
    quality_latency_table,
    results_table,
    table9,
    transition_table,
    transitions,
)
from sur_lab.studies.natural_qa.study import (
    FIXED,
    FOLDER,
    LATENCY,
    NAME,
    NOTEBOOK,
    POWER,
    PRESETS,
    PRIMARY,
    PRIMARY_BUDGET,
    PRIMARY_POWER,
    REFERENCE_FAMILY,
    RIVALS,
    STUDY,
    NaturalQAStudy,
    decide_families,
)

__all__ = [
    # cases
    "DATASET_LABELS", "PAPER_ALLOCATORS", "PLACEMENTS", "QA_DATASETS", "REFERENCES", "PlacementCase", "Source",
    "available_methods", "build_case", "build_cases", "choose_passages", "clean_prompt_ids", "passage_admissible",
    "qa_inputs", "select_panel", "sweep_cases", "timed_case_ids", "trial_case_id",
    # study
    "FIXED", "FOLDER", "LATENCY", "NAME", "NOTEBOOK", "POWER", "PRESETS", "PRIMARY", "PRIMARY_BUDGET", "PRIMARY_POWER",
    "REFERENCE_FAMILY", "RIVALS", "STUDY", "NaturalQAStudy", "decide_families",
    # report
    "CASE_KEYS", "LATENCY_PARTS", "aggregate_trials", "conclusion", "condition_label", "condition_lines",
    "dataset_em_table", "dataset_lines", "latency_breakdown", "lead_of", "paired_difference_table", "panel_table",
    "plot_figure4", "plot_quality_latency", "plot_transitions", "quality_latency_table", "results_table", "table9",
    "transition_table", "transitions",
]
