"""Notebook 10's design, fixed before any run: the reference paths' labels (``SHIFT``, ``PREFIX``,
``REFERENCE``), the regions of a turn's first change (:data:`REGIONS`), the agreement margin
(:data:`MAX_AGREEMENT_LOSS`, :data:`AGREEMENT_MARGIN`) and the declared comparisons (:data:`PRIMARY`,
:data:`AGREEMENT_FAMILY`, :data:`KIND_FAMILY`, :data:`REGION_FAMILY`). Below both the study
(:mod:`sur_lab.studies.agent_traces.study`) and its report (:mod:`sur_lab.studies.agent_traces.report`).
"""

from __future__ import annotations

from sur_lab.analysis.decisions import Family, Margin
from sur_lab.studies.agent_traces.cases import QUESTION_KINDS

__all__ = ["SHIFT", "PREFIX", "REFERENCE", "REGIONS", "MAX_AGREEMENT_LOSS", "AGREEMENT_MARGIN", "PRIMARY",
           "AGREEMENT_FAMILY", "KIND_FAMILY", "REGION_FAMILY"]

#: Path labels of the references.
SHIFT, PREFIX, REFERENCE = "sync 0% (Shift)", "prefix reuse", "re-prefill"
#: Regions of a turn's first change: a pure append (nothing kept after it), the first or second half of the prompt.
REGIONS = ("append", "first half", "second half")
#: "No more than 5 points of agreement lost against prefix reuse" (issue 27's tolerance): the equivalence margin of the
#: agreement comparisons, and the bound of the per-region loss claims: claimed only when the exact (Clopper–Pearson)
#: upper bound of the rate of turns on which the sync path loses re-prefill's answer that prefix reuse kept is at most
#: this (:func:`sur_lab.analysis.decisions.bound_claim`; turns count as units there: exact per turn, conservative in
#: ignoring the turns sync gains).
MAX_AGREEMENT_LOSS = 0.05
AGREEMENT_MARGIN = Margin(MAX_AGREEMENT_LOSS, "issue 27's tolerance: at most 5 points of agreement lost against "
                          "prefix reuse")
#: The declared comparisons of notebook 10 (issues 36 and 40; :mod:`sur_lab.analysis.decisions`), fixed before any
#: run, every one paired by turn with a trace's turns clustered. The primary: the lead sync path against prefix reuse
#: on time to first token over every turn after the first, "faster" only when the speed-up's interval lies above 1
#: (decidable at ``default``: six traces that all gain give the exact sign-flip test p = 1/32).
PRIMARY = Family("primary", "ratio", "prefix reuse's TTFT over the lead sync path's on every turn after the first",
                 primary=True)
#: What the speed-up costs in answers: the lead sync path against prefix reuse on agreement with re-prefill over the
#: later turns whose question reaches edited or earlier text (:data:`REACHING`), "equivalent" only when its whole 90 %
#: interval lies within :data:`AGREEMENT_MARGIN`, "loses to" when the loss is shown. Prefix reuse recomputes every row
#: from the first change, so it answers as re-prefill does up to rounding: this is the sync path's agreement loss on
#: the questions a stale cache can get wrong. Equivalence within 5 points needs about 55 reaching turns without a loss
#: (Newcombe's 90 % interval; more with losses or clustering): the ``paper`` preset's size, not ``default``'s, which
#: prints the smallest difference it could separate.
AGREEMENT_FAMILY = Family("agreement on the reaching questions", "binary", "the lead sync path minus prefix reuse: "
                          "agreement with re-prefill on every later turn whose question reaches edited or earlier text",
                          margin=AGREEMENT_MARGIN, max_size=1)
KIND_FAMILY = Family("agreement by question kind", "binary", "the lead sync path minus prefix reuse: agreement with "
                     "re-prefill within each question kind", margin=AGREEMENT_MARGIN, max_size=len(QUESTION_KINDS))
REGION_FAMILY = Family("speed-up by region of the first change", "ratio",
                       "prefix reuse's TTFT over the lead sync path's within each region of the first change")
