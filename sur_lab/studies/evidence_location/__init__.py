"""Matched evidence-location experiment: cases that exchange evidence across a fixed deletion (appendix 10.1).

Each *source* (a natural-QA question) yields four cases with one fixed edit geometry: slot width W, edit index p
(tokens before the deleted span, chat head included), deletion width d, and a retained suffix of S_short or S_long
tokens. The context, token for token::

    head | lead filler (p - W - |head|) | upstream slot (W) ‖ deleted filler (d) ‖ downstream slot (W) | tail | [ext]
    └──────────────────── prefix, p tokens ──────────────┘                     └──── suffix, S tokens ────────────┘

- the **evidence bundle** (every annotated supporting passage of the source, untruncated, in dataset order) and the
  **control bundle** (one to four of the source's own non-supporting documents, as many as it has supporting ones,
  that fit) are each extended to exactly W tokens by whole natural-text chunks (2WikiMultiHopQA corpus paragraphs)
  and then the neutral padding family (:func:`neutral_padding`);
- the two bundles fill the **exchange slots** immediately before and after the deletion: evidence *upstream* (in the
  valid prefix, control downstream) or *downstream* (in the stale suffix, control upstream);
- the suffix continues with a **neutral tail** of ``S_short - W`` filler tokens; the *long* cells append a tail
  extension of ``S_long - S_short`` filler tokens (whole chunks, then padding), crossing the exchange.

So within a tail condition the exchange holds the edit index, deletion width, slot width, suffix length, token
multiset, query and answer target fixed; the tail contrast changes filler, stale-state volume and evidence-to-query
distance together (appendix 10.1). Cells are named ``upstream/short``, ``downstream/short``, ``upstream/long``,
``downstream/long`` (:data:`CELLS`).

**Geometry** is chosen per source from a fixed candidate list by tokenization alone, before any model runs: the first
candidate whose slot holds the evidence bundle and at least one control document, and whose construction passes every
check. The paper's list is :data:`GEOMETRIES` ``["paper"]`` (d = 256); ``"half"`` and ``"quarter"`` scale every
width (d included) for small models and CPU runs.

**Checks before execution** (:func:`check_source`): every segment round-trips through the tokenizer on its own and the
edit's ids are exactly the planned segment ids (boundary tokenization: sur_lab edits are token segments,
:mod:`sur_lab.edits`); widths are exact; no inserted non-evidence content (control documents, filler chunks,
padding, deleted span, tail) contains a normalised answer alias or a support title as whole words; no inserted
content holds a special-token id. A source that cannot be built is **excluded and counted** with its reason
(:class:`Exclusion`); no decision reads a model output.

Choices the paper leaves open, fixed here (all before any model output): filler chunks are drawn per source from a
generator seeded by ``(seed, crc32("dataset/id"))`` (:func:`sur_lab.data.text.source_rng`) and taken
first-fit in that order while one of the next :data:`MAX_FILL_SKIPS` candidates fits and at least
:data:`MIN_FILL_TOKENS` tokens remain, then padded; answer aliases are checked for span and number answers (a yes/no
gold says nothing about a passage), as natural QA does; the query is the chat template's ``Question: ...`` turn
tail, and the blank line before it closes the last document segment. ``docs/studies/evidence_location.md`` has the
design, geometry and exclusion rules.

Modules:

* :mod:`~sur_lab.studies.evidence_location.sources`: candidate geometries, token segments, one source's construction
  and checks (:func:`build_source`, :func:`check_source`, :class:`Exclusion`).
* :mod:`~sur_lab.studies.evidence_location.cases`: the four cells of a source (:class:`LocationCase`,
  :func:`build_cells`), the panel (:func:`build_panel`, :class:`Panel`) and the cells as sweep cases.
* :mod:`~sur_lab.studies.evidence_location.report`: Tables 15 and 16 (:func:`factorial_table`, :func:`table16`), the
  replay minus fixed-slot gaps (:func:`slot_gap_table`), the four cells' figure and the findings (:func:`findings`).
* :mod:`~sur_lab.studies.evidence_location.study`: the study on the :class:`~sur_lab.studies.base.Study` base
  (:data:`STUDY`, :data:`PRESETS`, the declared families and :data:`POWER`), the fixed-slot refresh
  (:class:`FixedSlotRefresh`) and the panel file its sweep writes (:data:`PANEL_FILE`).
* :mod:`~sur_lab.studies.evidence_location.pooled`: several models' runs on their common feasible panel
  (:func:`combine`, :func:`common_panel`, :func:`pooled_report`).
"""

from sur_lab.studies.evidence_location import cases, pooled, report, sources, study
from sur_lab.studies.evidence_location.sources import *  # noqa: F403
from sur_lab.studies.evidence_location.cases import *  # noqa: F403
from sur_lab.studies.evidence_location.report import *  # noqa: F403
from sur_lab.studies.evidence_location.study import *  # noqa: F403
from sur_lab.studies.evidence_location.pooled import *  # noqa: F403

__all__ = [*sources.__all__, *cases.__all__, *report.__all__, *study.__all__, *pooled.__all__]
