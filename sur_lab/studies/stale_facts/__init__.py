"""Stale facts: agent-style edits that supersede a value, on real haystack text (issues 26 and 40).

The edits agents make supersede a fact: a setting is updated, a tool output is replaced by a newer one. The retained
suffix then carries the *old* fact in its states ("Models Take Notes at Prefill", arXiv 2606.17107), and an answer
that gives the old value is *stale*, not merely wrong. Five task families, each a chat prompt whose documents are
shuffled 2WikiMultiHopQA corpus paragraphs (``Title: ...`` blocks separated by blank lines, as in
:mod:`sur_lab.studies.niah`) with record blocks placed at controlled depths. The three families of issue 26 are kept as
controls (:data:`CONTROL_FAMILIES`):

- ``value_update``: a fact block ``"The deploy target for service KEY is V1."`` is replaced by the same sentence with
  V2. The edit is the replacement layout of :meth:`sur_lab.session.EditSession.replace`
  (:func:`sur_lab.edits.splice_replacement`, built from text by :func:`sur_lab.edits.replacement_edit`): the
  prefix ends with the inserted block, the deleted span is the old block, the suffix follows. The answer-bearing text
  is the inserted block itself (distance 0).
- ``superseded_tool_output``: an earlier tool-output block holding V1 is deleted; a later one holding V2 stays, a
  controlled distance downstream of the edit. The answer-bearing text is the later block (in the suffix).
- ``multi_key``: several keys, each with its own fact block; one key's block is replaced (as ``value_update``), the
  others are distractors. The query asks for the updated key (answer-bearing text: the inserted block) or for an
  untouched key whose block sits a controlled distance downstream of the edit.

In those three, every arm but Dirty sees the answer in clean states and the old value is physically gone, so a stale
answer can come only from residual notes in suffix states. The two families of issue 40 (:data:`DERIVED_FAMILIES`)
put the answer-bearing text downstream of the edit, dependent on it, as in "Models Take Notes at Prefill":

- ``derived_record``: the fact block of ``value_update``, and downstream a derived record ("service D is the canary
  of service KEY and always uses the same deploy target as service KEY"); the query asks D. The derived record names
  no value: its states took note of V1 when they were computed.
- ``agent_note``: a tool output holding V1 is replaced by the same call's output holding V2 (a re-run), and
  downstream an agent note plans the rollout to "the deploy target that get_deploy_target returned"; the query asks
  the plan.

Both list every case value in an earlier inventory tool output (the old value in another role, so a stale answer can
be copied; ``inventory=False`` leaves it out). The answer-bearing span (:attr:`StaleCase.bearing_token_span`) is the
derived block, in the suffix. Each replacement case also carries its Erratum placement control
(:func:`placement_control`): the same inserted block right before the question, where Erratum's note sits, so Erratum
and the repairs can be compared at equal recency.

An exploratory family (:data:`REBOUND_FAMILIES`, built on request, not in the roster) moves the values themselves
downstream: ``rebound_reference`` replaces the derived record "service KEY ... uses the same deploy target as service
A" by the same record naming service B, and both A's and B's fact blocks follow it (their states computed while the
old reference was visible); the query asks KEY, gold is B's value, stale A's. On the study model the answer did not
follow the reference under any arm (Dirty included), so it is not a study family; docs/studies/stale_facts.md says
what issue 40's reachability check found and how to rerun it.

Every block holding the key or a value is its own passage segment; the key (``" " + KEY``) and every value
(``" " + V``) are whole token spans in the prompt, tokenized exactly as on their own (checked at construction, with
values redrawn until they are; tested on the SmolLM2 and Qwen tokenizers). The old value appears exactly once in the
context before the edit (in the deleted span) and never in the edited context (the derived families: besides the
inventory). The query ends with an answer prefix
(``"The current deploy target for service KEY is"``, as RULER's NIAH prefix), so the first answer step predicts the
value's first token: :func:`sur_lab.analysis.endpoints.gold_margin` reads it (``gold_token``).

Depth and distance are fractions of the filler tokens (as NIAH depths): the edit sits at ``edit_depth``, the
answer-bearing block (superseded tool output, an untouched key) at ``edit_depth + distance``. Both are recorded in
tokens too (``edit_depth_tokens``, ``answer_distance_tokens``), so the edit-local claim of "Contiguity, Not
Importance" (arXiv 2609.17983: a window right after the edit recovers the answer margin, less so when the
answer-bearing text sits far downstream) can be tested where it is said to fade.

Scoring (:func:`classify_answer`): every case value is searched in the answer as a whole word (case-insensitive).
``correct`` (the gold value alone: EM), ``stale`` (the old value of the asked key, or of the edited key a derived block refers
to, without the gold one), ``mixed``
(the gold value and another case value), ``distractor`` (another key's value only) or ``wrong`` (none).

Modules (every public name is re-exported here, so ``from sur_lab.studies import stale_facts; stale_facts.X`` reaches
each):

* :mod:`~sur_lab.studies.stale_facts.design`: the task families (:data:`FAMILIES`, :data:`DERIVED_FAMILIES`,
  :data:`REBOUND_FAMILIES`, :data:`CONTROL_FAMILIES`), the compared references and allocators, :data:`PRESETS` and the
  declared comparisons (:data:`PRIMARY`, :data:`EM_FAMILY`, :data:`STALE_FAMILY`, :data:`PLACEMENT_FAMILY`), fixed
  before any run.
* :mod:`~sur_lab.studies.stale_facts.cases`: the wording (:class:`StaleTemplates`), the case (:class:`StaleCase`) and
  the answer classes (:func:`classify_answer`, :func:`answer_class`, :func:`stale_fact_scorer`,
  :func:`is_stale_answer`).
* :mod:`~sur_lab.studies.stale_facts.construction`: building cases (:func:`build_stale_case`,
  :func:`build_stale_cases`, :func:`stale_cases`), the Erratum placement control (:func:`placement_control`) and
  :func:`pre_edit_context_ids`.
* :mod:`~sur_lab.studies.stale_facts.study`: :data:`STUDY`, the :class:`~sur_lab.studies.base.Study`
  (:class:`StaleFactsStudy`) declaring :data:`FIXED`, its cases, methods, families and power (:data:`POWER`); the
  placement control's folder and records (:func:`control_folder`, :func:`late_records`).
* :mod:`~sur_lab.studies.stale_facts.report`: the endpoints (:func:`add_stale_endpoints`), tables, paired
  differences, stale rates, the conclusion lines (:func:`conclusion`) and the summary figure (:func:`plot_summary`).
"""

from sur_lab.studies.stale_facts import cases, construction, design, report, study
from sur_lab.studies.stale_facts.design import *  # noqa: F403
from sur_lab.studies.stale_facts.cases import *  # noqa: F403
from sur_lab.studies.stale_facts.construction import *  # noqa: F403
from sur_lab.studies.stale_facts.report import *  # noqa: F403
from sur_lab.studies.stale_facts.study import *  # noqa: F403
from sur_lab.studies.stale_facts.report import _arm  # noqa: F401 - notebook 09 and scripts/stale_facts_probe.py read it

__all__ = [*design.__all__, *cases.__all__, *construction.__all__, *report.__all__, *study.__all__]
