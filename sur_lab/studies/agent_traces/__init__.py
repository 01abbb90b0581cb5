"""Agent traces: whole prompts resent every turn, synced into one live cache, against prefix reuse (notebook 10).

An agent runtime rebuilds its whole prompt every turn and sends it again (issue 27). A trace here is built from the QA
data (development files only; the held-out "final evaluation only" files are never read): a system message, a task
and a plan, then per turn two tool outputs for that turn's source question, a quick *lookup* (one distractor passage)
and a *search* result (the supporting passages), and the edits agent runtimes make to the prompt:

- turn 1: a new turn appended, nothing else (the common agent turn);
- even turns from 2: the previous turn's lookup is removed with its call (superseded by that turn's search);
- turns from 3: the oldest full search output is compacted into a one-line summary (its titles);
- turn ``turns // 2``: the plan, near the start, is rewritten, and it changes the answer format (every answer from
  then on begins with :data:`FORMAT_PREFIX`);
- every turn: the new tool outputs appended at the end.

After each turn one question is asked, of a kind fixed by the schedule (:func:`question_kinds`, issue 40) so that most
questions need edited or earlier text, not only the output appended that turn: ``new`` (the turn's own question, the
control), ``reask-removed`` (the previous turn's question again after its lookup was removed: the answer sits in its
search output, downstream of the removal), ``reask-compacted`` (the question of the output compacted that turn: the
answer must come from its summary, or be "unknown"), ``combine`` (the two previous turns' questions answered together)
and ``format`` (the turn's own question right after the plan rewrite, in the new format). The gold of each question is
defined by the text that survives in that turn's prompt (:func:`build_trace`): a source answer where it can be read
from the named tool output, else "unknown" (:data:`UNKNOWN`; the system message asks for it). Every path follows the
same prompts with its own :class:`~sur_lab.session.EditSession`, so staleness left by a budgeted sync carries into
later turns as it would in an agent loop:

- ``sync b %``: :meth:`~sur_lab.session.EditSession.sync` with SUR at b % of the stale rows, always repairing
  (``SyncPolicy(0, 1.0)``: the study measures the raw repair; :class:`sur_lab.sync.SyncPolicy`'s defaults are chosen
  from it by ``scripts/bench_sync.py``);
- ``sync 0 % (Shift)``: the same diff with Shift only (deleted rows dropped, moved keys re-rotated, inserted rows
  prefilled, nothing refreshed: what llama.cpp's ``--cache-reuse`` does);
- ``prefix reuse``: recompute every row from the first change (what serving engines' prefix caches do);
- ``re-prefill``: prefill the whole prompt every turn, the reference.

Per (trace, turn, path) the study records the sync's path and row counts (:class:`~sur_lab.sync.SyncRecord`), the time
to first answer token (TTFT = the sync call + the query forward, unbatched, one request at a time), the tokens
recomputed, the greedy answer (its first token from that timed forward, the rest decoded for the turn's paths
together: a quality endpoint), the question's kind, EM against the turn's gold and agreement with re-prefill's
answer, and the cumulative cost over the trace so far. The report breaks agreement and EM down by question kind
(:func:`kind_table`) and by where the turn's first change lands (:func:`region_table`); every interval resamples whole
traces (a trace's turns are one cluster, :func:`sur_lab.analysis.decisions.paired_family`'s ``cluster``), the TTFT
ratio's included, and the declared comparisons are :func:`primary_table`'s.

Records: these per-turn rows are the study's own table, not :class:`sur_lab.sweeps.Record` objects. A sweep record is
one repair of one prepared edit (:func:`sur_lab.sweeps.run_case` prepares a case once and repairs it with every method
independently); here each path's state at turn t depends on its own repairs at turns 1..t-1 (accumulated staleness),
and a sync is a diff of many edits rather than one span. They are keyed rows of the one sweep store
(:meth:`sur_lab.sweeps.SweepStore.run_keyed`: a trace is a case, its rows keyed by turn and path): each finished trace
is written at once to its part file, so an interrupted run resumes, and the table is ``turns.parquet`` in the study's
sweep folder (:meth:`AgentTracesStudy.run`).

Modules (every public name is re-exported here, so ``from sur_lab.studies import agent_traces; agent_traces.X``
reaches each):

* :mod:`~sur_lab.studies.agent_traces.cases`: the traces (the fixed messages, :data:`QUESTION_KINDS`,
  :func:`question_kinds`, :func:`reachable`, :func:`build_trace`, :func:`split_traces`, :func:`build_traces`) and the
  query after a turn's prompt (:func:`query_text`).
* :mod:`~sur_lab.studies.agent_traces.design`: the reference paths' labels, the regions of the first change and the
  declared comparisons (:data:`PRIMARY`, :data:`AGREEMENT_FAMILY`, :data:`KIND_FAMILY`, :data:`REGION_FAMILY`,
  :data:`AGREEMENT_MARGIN`), fixed before any run.
* :mod:`~sur_lab.studies.agent_traces.run`: the paths (:class:`TracePath`, :func:`default_paths`) and running them
  (:func:`run_trace`, :func:`run_traces`, :func:`add_cumulative`).
* :mod:`~sur_lab.studies.agent_traces.study`: :data:`STUDY`, the :class:`~sur_lab.studies.base.Study`
  (:class:`AgentTracesStudy`) declaring :data:`PRESETS`, :data:`FIXED`, its cases, methods, families and power
  (:data:`POWER`), and the resumable run (:meth:`AgentTracesStudy.run`).
* :mod:`~sur_lab.studies.agent_traces.report`: the tables (:func:`per_turn_table`, :func:`region_table`,
  :func:`kind_table`, :func:`summary_table`), the declared comparisons decided (:func:`primary_table`) and the
  conclusion lines (:func:`conclusion`).
* :mod:`~sur_lab.studies.agent_traces.figures`: the figures (:func:`plot_cost_agreement`, :func:`plot_regions`,
  :func:`plot_kinds`).
"""

from sur_lab.studies.agent_traces import cases, design, figures, report, run, study
from sur_lab.studies.agent_traces.cases import *  # noqa: F403
from sur_lab.studies.agent_traces.design import *  # noqa: F403
from sur_lab.studies.agent_traces.run import *  # noqa: F403
from sur_lab.studies.agent_traces.report import *  # noqa: F403
from sur_lab.studies.agent_traces.figures import *  # noqa: F403
from sur_lab.studies.agent_traces.study import *  # noqa: F403

__all__ = [*cases.__all__, *design.__all__, *run.__all__, *study.__all__, *report.__all__, *figures.__all__]
