"""Erasing-NIAH: two same-key needles in a haystack of real Wikipedia paragraphs; deleting one changes the answer
(section 4.2, appendix 7.5). Notebook 02 and ``sur-lab sweep niah``.

Modules (every public name is re-exported here, so ``from sur_lab.studies import niah; niah.X`` reaches each):

* :mod:`~sur_lab.studies.niah.cases`: the case construction (RULER's multi-value NIAH wording over shuffled
  2WikiMultiHopQA corpus paragraphs, :func:`build_niah_case`, :func:`build_niah_cases`, :class:`NiahCase`) and the
  strict answer parser and scorer (:func:`parse_niah_answer`, :func:`niah_exact_match`, :func:`niah_scorer`).
* :mod:`~sur_lab.studies.niah.design`: the methods compared (:data:`PAPER_ALLOCATORS`, :data:`BEYOND_PAPER`, SUR's
  design factors :data:`SUR_FACTORS` and the boundary controls: :data:`ABLATION`), the comparisons' budgets and the
  declared families (:data:`PRIMARY`, :data:`RIVALS`, :data:`BEYOND`, ...), fixed before any run.
* :mod:`~sur_lab.studies.niah.study`: :data:`STUDY`, the :class:`~sur_lab.studies.base.Study` (:class:`NiahStudy`)
  declaring :data:`PRESETS` (sizes), :data:`FIXED` (the other parameters' defaults), its cases, methods, families and
  power (:data:`POWER`); the base's :meth:`~sur_lab.studies.base.Study.sweep` returns the records, the
  sweep folder (named the same way for the notebook and the command line, so each resumes the other's records) and
  the cases.
* :mod:`~sur_lab.studies.niah.report`: the tables and conclusion lines (:func:`budget_table`,
  :func:`paired_differences`, :func:`decide_families`, :func:`conclusion`, :func:`table12`, :func:`ablation_table`,
  :func:`combine` across models).
* :mod:`~sur_lab.studies.niah.figures`: the figures (:func:`plot_budget_curves`, :func:`plot_paired_differences`,
  :func:`plot_intervals`, :func:`plot_model_panels`, :func:`plot_budget_heatmap`).
* :mod:`~sur_lab.studies.niah.matched`: the matched-token protocol on a holdout roster (Table 14:
  :func:`matched_sweep`, :func:`matched_folder`, :class:`MatchedRegion`, :class:`MatchedTokens`, :func:`table14`).
"""

from sur_lab.studies.niah import cases, design, figures, matched, report, study
from sur_lab.studies.niah.cases import *  # noqa: F403
from sur_lab.studies.niah.design import *  # noqa: F403
from sur_lab.studies.niah.report import *  # noqa: F403
from sur_lab.studies.niah.figures import *  # noqa: F403
from sur_lab.studies.niah.study import *  # noqa: F403
from sur_lab.studies.niah.matched import *  # noqa: F403
from sur_lab.studies.niah.matched import _region_allowance  # noqa: F401 - tests/test_design_evidence.py reads it

__all__ = [*cases.__all__, *design.__all__, *study.__all__, *report.__all__, *figures.__all__, *matched.__all__]
