"""The non-prefix reuse study: SAFE-KV's repair units, selectors, protocols and endpoints for composed KV caches.

"SAFE-KV" is the paper's method; this package is the study of non-prefix reuse that applies it. Modules:

* :mod:`~sur_lab.studies.noprefix.composition`: composing independently cached documents into one KV cache (Figure 1)
  and the bridge to the deletion executors (:func:`composition_edit`).
* :mod:`~sur_lab.studies.noprefix.selection`: selectors and repair units as supports (:class:`RepairSpec`,
  :func:`plan_repair`).
* :mod:`~sur_lab.studies.noprefix.protocol`: the forward and donor protocols, the repair-unit sets, RAG requests
  built from QA examples (:func:`build_request`).
* :mod:`~sur_lab.studies.noprefix.study`: the study (:class:`NoprefixStudy` on the
  :class:`~sur_lab.studies.base.Study` base; :data:`STUDY` the main design, :data:`POSITIONS` the position sweep;
  :data:`PRESETS`, :data:`FIXED`): composed requests as sweep cases (:class:`ComposedCase`), repair units as sweep
  methods (:class:`RepairMethod`), records in the one schema through :func:`sur_lab.sweeps.run_case`;
  :func:`runs_table` and :func:`measure_drift` for the tables.
* :mod:`~sur_lab.studies.noprefix.reporting`: drift tables, summaries with bootstrap intervals (median and p95 time to
  first logit), the robustness checks (the EM-correct stratum, a second model family: :func:`stratum_table`,
  :func:`robustness_table`) and the largest workload's quality gate (:func:`quality_gate`) with the paired donor −
  forward bootstrap (:func:`protocol_gap`).
* :mod:`~sur_lab.studies.noprefix.ledger`: the declared comparisons and the primary one's power design (:data:`POWER`),
  the operating rule (:func:`operating_rule`), the design ledger (:func:`design_ledger`) and the conclusion lines.
* :mod:`~sur_lab.studies.noprefix.figures`: the figures (SAFE-KV Figures 2-5 analogues).


A composed cache (:mod:`sur_lab.studies.noprefix.composition`) is repaired by re-encoding a *repair unit*, a set of document positions
expressed as a :class:`~sur_lab.budget.Support` over the ``S`` positions after the shared prefix, through the same
executor interface as deletion repair (``get_executor(name)(lm, composed, edit, support)``). Units (SAFE-KV section 1,
Figure 1, Table 27):

- ``doc``: the selected document(s) only (Fig. 1c);
- ``window``: the selected document and the next ``width - 1`` (w2–w4);
- ``suffix``: the causal suffix from the selected start document to the query (Fig. 1d, SAFE-KV's repair);
- ``adaptive``: that suffix trimmed at its start to the allowance ``B(S, b)`` of a budget b (Eq. 3), so it stays
  causally closed up to the query;
- ``linked``: the selected documents and the last document (the one the query reads last) as separate intervals,
  a "reasoning chain" of evidence linked to the query with stale gaps in between;
- ``sur``: SUR's budgeted allocator (Algorithm 1) over the composed documents, a further comparison;
- ``none`` (prefix composition, no repair) and ``full`` (full prefill, the reference).

Selectors: ``risk`` (forward-free drift score), ``query`` (frozen-embedding relevance), ``hybrid`` (the mean of the two
selectors' scaled ranks) and ``oracle`` (gold evidence, a diagnostic). Start candidates. A selector scores the n
documents; ``K`` candidates are its top-K documents (earlier document first
among ties) and the start of windows, suffixes and adaptive suffixes is the earliest candidate ("K1", "K2").

Protocols: ``forward`` recomputes the support with an executor (actual forwarding); ``donor`` copies the support's rows
from the full-prefill cache, a diagnostic upper bound that needs the very cache repair avoids and that figures label
as such.

Endpoints (per request): answer preservation (the generated answer equals full prefill's after normalization,
:func:`answers_agree`), token exactness (identical generated ids), gold EM (:func:`sur_lab.analysis.scoring.score_example`),
changed-wrong (answer changed and gold-wrong), repair ratio ``B / S`` (fraction of the reused document context
re-encoded) and time to first logit (TTFL: compose + select + refresh + query forward, ms) against full prefill's
(forward of the S document tokens + query forward after the shared prefix). Operating rule: serve by full prefill when
no reuse path reaches the required preservation with a smaller TTFL.

Source: SAFE-KV (Zhang, 2026): abstract, Figures 1–5, Tables 20 and 27; SUR: section 3.2 and Algorithm 1 of the
budgeted KV-cache repair paper.
"""

from sur_lab.studies.noprefix import composition, figures, ledger, protocol, reporting, selection, study
from sur_lab.studies.noprefix.composition import *  # noqa: F403
from sur_lab.studies.noprefix.selection import *  # noqa: F403
from sur_lab.studies.noprefix.protocol import *  # noqa: F403
from sur_lab.studies.noprefix.reporting import *  # noqa: F403
from sur_lab.studies.noprefix.ledger import *  # noqa: F403
from sur_lab.studies.noprefix.figures import *  # noqa: F403
from sur_lab.studies.noprefix.study import *  # noqa: F403

__all__ = [*composition.__all__, *selection.__all__, *protocol.__all__, *reporting.__all__, *ledger.__all__,
           *figures.__all__, *study.__all__]
