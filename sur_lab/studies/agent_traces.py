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

Source: section 3 (evolving contexts), Algorithm 1 (one repair over the union of the stale suffix), Eq. 2 (Shift),
Eq. 3 (allowance), appendix 7.5 (EM, agreement); issues 27 and 40.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from sur_lab.analysis.decisions import (
    BEATS,
    FAILS,
    HOLDS,
    LOSES,
    Family,
    Margin,
    PowerBasis,
    PowerDesign,
    bound_claim,
    bound_sentence,
    family_lines,
    in_units,
    paired_family,
    proportion_interval,
)
from sur_lab.analysis.scoring import NONE_PREDICTIONS, agreement, exact_match, extract_answer, normalize_answer
from sur_lab.answer import AnswerBatch
from sur_lab.data.qa import QAExample, load_qa, select_sources
from sur_lab.data.text import passage_block
from sur_lab.edits import chat_segments
from sur_lab.executors import get_executor
from sur_lab.fingerprint import digest, model_fingerprint, versions
from sur_lab.models import LoadedModel
from sur_lab.session import EditSession
from sur_lab.studies.base import Report, Study
from sur_lab.sweeps.store import SweepStore
from sur_lab.sync import SyncPolicy

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
#: Path labels of the references.
SHIFT, PREFIX, REFERENCE = "sync 0% (Shift)", "prefix reuse", "re-prefill"
#: Regions of a turn's first change: a pure append (nothing kept after it), the first or second half of the prompt.
REGIONS = ("append", "first half", "second half")
#: The power statement's basis (issue 40; :data:`POWER`): a planning value, not a measurement. The SD over traces of a
#: trace's mean log TTFT ratio (prefix reuse over sync, turns after the first) is taken as 0.2 (a trace's speed-up
#: within about ±20 %), for CPU timings on a shared 2-core machine; a measured default run replaces it.
PRIMARY_POWER = PowerBasis(0.2, "a planning value (no published spread): 0.2 per trace, timings on a shared CPU",
                           unit="x")

SYSTEM = ("You are a research agent. Tool outputs arrive in turns; answer each question with a short answer only, "
          "from the tool outputs shown; if they do not give it, answer 'unknown'.")
TASK = "Task: answer the user's questions from the tool outputs below."
PLAN = "Plan: read each tool output, keep what answers the question, drop what is superseded, then answer briefly."
#: The answer format the revised plan asks for: every answer from the rewrite turn on begins with it.
FORMAT_PREFIX = "Final:"
REWRITTEN = ("Plan (revised): older outputs are summarised; use the latest search results. From now on begin every "
             f"answer with '{FORMAT_PREFIX}', e.g. '{FORMAT_PREFIX} Paris'.")
#: Question kinds (issue 40): what the question of a turn needs. ``new``: the turn's own question, its evidence in the
#: search output appended that turn (the control); ``reask-removed``: the previous turn's question again, after that
#: turn's lookup was removed (its search output survives, downstream of the removal); ``reask-compacted``: the question
#: of the turn whose search output was compacted this turn (the answer is in its one-line summary, or "unknown");
#: ``combine``: the questions of the two turns before, answered together ("first; second"), from their two search
#: outputs; ``format``: the turn's own question on the turn the plan is rewritten to a new answer format.
QUESTION_KINDS = ("new", "reask-removed", "reask-compacted", "combine", "format")
#: The kinds whose question reaches edited or earlier text (every kind but ``new``).
REACHING = QUESTION_KINDS[1:]
#: The gold of a question whose answer did not survive: "unknown" and the usual phrasings of it
#: (:data:`sur_lab.analysis.scoring.NONE_PREDICTIONS`), "unknown" first.
UNKNOWN = ("unknown", *(s for s in NONE_PREDICTIONS if s != "unknown"))
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


@dataclass(frozen=True)
class TracePath:
    """One way of keeping the cache in step with the prompt.

    Attributes:
        label: display name (``"sync 5%"``).
        method: the session's method (``"SUR"``, ``"Shift"`` or ``"Re-prefill"``).
        budget_pct: b, % of the stale rows (NaN for prefix reuse and re-prefill; 0 for Shift).
        policy: the :class:`~sur_lab.sync.SyncPolicy` of its syncs.
    """

    label: str
    method: str
    budget_pct: float
    policy: SyncPolicy


def default_paths(budgets: Sequence[float] = (2, 5, 10)) -> list[TracePath]:
    """sync at each budget (always repairing), sync 0 % (Shift), prefix reuse and re-prefill, in that order.

    Raises:
        ValueError: naming ``budgets`` when empty or a budget is outside (0, 100].
    """
    if not len(budgets):
        raise ValueError("budgets is empty; give at least one budget in (0, 100]")
    for b in budgets:
        if not 0 < float(b) <= 100:
            raise ValueError(f"budgets holds {b!r}; each budget must lie in (0, 100] (0 % is the Shift path)")
    always = SyncPolicy(0, 1.0)
    paths = [TracePath(f"sync {float(b):g}%", "SUR", float(b), always) for b in budgets]
    paths.append(TracePath(SHIFT, "Shift", 0.0, always))
    paths.append(TracePath(PREFIX, "SUR", float("nan"), SyncPolicy(min_stale_rows=2**62)))
    paths.append(TracePath(REFERENCE, "Re-prefill", float("nan"), always))
    return paths


# ---------------------------------------------------------------------------------------------------------------------
# Traces


def question_kinds(turns: int) -> list[str]:
    """The question kind of each turn of a ``turns``-turn trace (:data:`QUESTION_KINDS`), fixed by the edit schedule
    before any model output is seen.

    Turns 0 and 1 ask their own question (``new``); the plan-rewrite turn (``turns // 2``, when > 0) asks ``format``;
    every other turn takes, of the reaching kinds its edits allow (``reask-removed`` on even turns, where the previous
    lookup is removed; ``reask-compacted`` from turn 3, where a search output is compacted; ``combine`` from turn 2),
    the one asked least so far, ties in the order of :data:`QUESTION_KINDS`. Eight turns: new, new, reask-removed,
    reask-compacted, format, combine, reask-removed, reask-compacted.

    Raises:
        ValueError: naming ``turns`` when it is not an integer >= 2.
    """
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 2:
        raise ValueError(f"turns={turns!r} must be an integer >= 2")
    asked = dict.fromkeys(("reask-removed", "reask-compacted", "combine"), 0)
    kinds = []
    for t in range(turns):
        if t == turns // 2:
            kinds.append("format")
        elif t < 2:
            kinds.append("new")
        else:
            allowed = [k for k in asked if (k != "reask-removed" or t % 2 == 0) and (k != "reask-compacted" or t >= 3)]
            kind = min(allowed, key=asked.__getitem__)
            asked[kind] += 1
            kinds.append(kind)
    return kinds


def reachable(answers: Sequence[str], text: str, *, full: bool) -> bool:
    """Whether a question's answer can be read from ``text``: some gold answer, normalized
    (:func:`~sur_lab.analysis.scoring.normalize_answer`), occurs in the normalized text as whole words. A yes/no answer
    is never written out: it counts as reachable from a ``full`` (not summarised) search output only."""
    words = f" {normalize_answer(text)} "
    for a in answers:
        norm = normalize_answer(a)
        if norm in ("yes", "no"):
            if full:
                return True
        elif norm and f" {norm} " in words:
            return True
    return False


def _block_label(block: Mapping[str, Any]) -> str:
    return f"{block['kind']} {block['turn'] + 1}" + ("" if block["full"] else " (summarised)")


def build_trace(tokenizer, examples: Sequence[QAExample], *, max_doc_tokens: int = 96) -> dict:
    """One trace: a turn per source question, with the edits and the question kinds of the module docstring.

    Args:
        tokenizer: the model's tokenizer (passages are capped with it).
        examples: the turns' source questions (one per turn, >= 2), each with a supporting and a distractor passage.
        max_doc_tokens: per-passage token cap (whole sentences kept; >= 8).

    Returns:
        ``{"id", "turns": [{"messages", "question", "answers", "dataset", "answer_type", "edits", "kind", "asks",
        "evidence", "known", "format"}, ...]}``: the whole prompt of each turn (chat messages); the question asked
        after it and its kind (:func:`question_kinds`); ``asks``, the turns (0-based) whose source questions it asks;
        ``evidence``, the labels of the tool outputs the answer must come from (``"search 3"``, ``"search 1
        (summarised)"``); the gold ``answers`` (normalized EM over them): per asked turn its source answers where they
        are :func:`reachable` from its evidence output as it stands in this prompt, else :data:`UNKNOWN`; a combined
        question's parts joined as ``"first; second"``; from the plan rewrite on (``format``: True) each prefixed with
        :data:`FORMAT_PREFIX`; ``known``, whether every part is reachable; and the edits made at that turn
        (``"+"``-joined names). This is the JSON form ``scripts/bench_sync.py --traces`` reads.

    Raises:
        ValueError: naming ``examples`` (fewer than 2, or one without supporting or distractor passages) or
            ``max_doc_tokens`` (< 8).
    """
    if len(examples) < 2:
        raise ValueError(f"examples holds {len(examples)} questions; a trace needs >= 2 turns")
    if max_doc_tokens < 8:
        raise ValueError(f"max_doc_tokens={max_doc_tokens} must be >= 8")
    for i, ex in enumerate(examples):
        if not ex.distractors or not ex.supporting:
            raise ValueError(f"examples[{i}] needs supporting and distractor passages")
    head = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK},
            {"role": "assistant", "content": PLAN}]
    blocks: list[dict] = []  # tool calls and outputs in prompt order: kind, turn, full (not compacted), messages
    turns = []
    n = len(examples)
    kinds = question_kinds(n)
    formatted = False
    for t, ex in enumerate(examples):
        edits, compacted = [], None
        full = [b for b in blocks if b["kind"] == "search" and b["full"]]
        if t >= 3 and len(full) > 1:
            compacted = full[0]
            titles = "; ".join(line[len("Title: "):] for line in compacted["output"]["content"].splitlines()
                               if line.startswith("Title: "))
            compacted.update(full=False, output={"role": "tool",
                                                "content": f"Search {compacted['turn'] + 1} (summarised): {titles}."})
            edits.append("compact")
        if t == n // 2 and t > 0:
            head[2] = {"role": "assistant", "content": REWRITTEN}
            formatted = True
            edits.append("plan")
        if t >= 2 and t % 2 == 0:  # the previous turn's lookup, superseded by its search
            blocks = [b for b in blocks if not (b["kind"] == "lookup" and b["turn"] == t - 1)]
            edits.append("remove")
        for kind, passages in (("lookup", ex.distractors[:1]), ("search", ex.supporting)):
            blocks.append({"kind": kind, "turn": t, "full": True,
                           "call": {"role": "assistant", "content": f"{kind}({ex.question!r})"},
                           "output": {"role": "tool", "content": f"{kind.capitalize()} {t + 1}:\n"
                                      + passage_block(tokenizer, passages, max_doc_tokens)}})
        edits.append("append" if t else "prefill")
        kind = kinds[t]
        asks = {"reask-removed": [t - 1], "reask-compacted": [compacted["turn"] if compacted else -1],
                "combine": [t - 2, t - 1]}.get(kind, [t])
        searches = {b["turn"]: b for b in blocks if b["kind"] == "search"}
        parts, known, evidence = [], True, []
        for k in asks:
            block = searches[k]
            evidence.append(_block_label(block))
            if reachable(examples[k].answers, block["output"]["content"], full=block["full"]):
                parts.append(list(examples[k].answers))
            else:
                parts.append(list(UNKNOWN))
                known = False
        if kind == "combine":
            q = (f"Answer both questions, separated by a semicolon: (1) {examples[asks[0]].question} "
                 f"(2) {examples[asks[1]].question}")
            gold = [f"{a}; {b}" for a in parts[0] for b in parts[1]]
        else:
            q, gold = examples[asks[0]].question, parts[0]
        if formatted:
            gold = [f"{FORMAT_PREFIX} {g}" for g in gold]
        messages = head + [m for b in blocks for m in (b["call"], b["output"])]
        turns.append({"messages": [dict(m) for m in messages], "question": q, "answers": gold,
                      "dataset": ex.dataset, "answer_type": ex.answer_type, "edits": "+".join(edits), "kind": kind,
                      "asks": asks, "evidence": evidence, "known": known, "format": formatted})
    return {"id": f"{examples[0].dataset}:{examples[0].id}", "turns": turns}


#: The datasets a trace can draw from: those scored by normalized span EM over aliases, so that a combined, formatted
#: or "unknown" gold is a plain list of strings (IIRC's DROP rule scores a bag of spans, which does not compose).
TRACE_DATASETS = ("hotpotqa", "2wikimultihopqa", "musique")


def _check_datasets(datasets: Sequence[str]) -> None:
    if not datasets:
        raise ValueError("datasets is empty; give at least one QA dataset key")
    bad = [d for d in datasets if d not in TRACE_DATASETS]
    if bad:
        raise ValueError(f"datasets holds {bad}; traces draw from {TRACE_DATASETS} (span EM over aliases: a combined "
                         "or formatted gold must be a list of strings)")


def split_traces(n_traces: int, capacities: Sequence[int]) -> list[int]:
    """How many of ``n_traces`` traces each dataset holds: evenly (the first ``n_traces % k`` datasets one more), each
    capped at its ``capacity`` (the traces its dev pool can fill with distinct sources), the excess handed one at a
    time, in dataset order, to the datasets with room. With room everywhere it is the even split.

    Raises:
        ValueError: naming ``n_traces`` when the capacities hold fewer traces.
    """
    k = len(capacities)
    share = [min(n_traces // k + (1 if d < n_traces % k else 0), int(c)) for d, c in enumerate(capacities)]
    left = n_traces - sum(share)
    if left > sum(int(c) - s for c, s in zip(capacities, share)):
        raise ValueError(f"n_traces={n_traces}: the datasets' dev pools hold {sum(int(c) for c in capacities)} traces "
                         "of distinct sources at this many turns; lower n_traces or turns, or add a dataset")
    while left:
        for d in range(k):
            if left and share[d] < capacities[d]:
                share[d] += 1
                left -= 1
    return share


def build_traces(tokenizer, p: Mapping[str, Any], *, seed: int = 0) -> list[dict]:
    """``p["n_traces"]`` traces of ``p["turns"]`` turns over ``p["datasets"]`` (development files), split by
    :func:`split_traces` (evenly while every dev pool has room; no source twice in a study), each dataset's sources
    chosen by one seeded selection (:func:`~sur_lab.data.qa.select_sources`) before any model output is seen.

    Raises:
        ValueError: naming ``n_traces`` (< 1, or more than the pools hold), ``turns`` (< 2) or ``datasets`` (empty, or
            a dataset outside :data:`TRACE_DATASETS`).
    """
    if p["n_traces"] < 1:
        raise ValueError(f"n_traces={p['n_traces']} must be >= 1")
    if p["turns"] < 2:
        raise ValueError(f"turns={p['turns']} must be >= 2")
    _check_datasets(p["datasets"])
    turns = p["turns"]
    pools = [[ex for ex in load_qa(ds, split="dev") if ex.distractors and ex.supporting] for ds in p["datasets"]]
    traces = []
    for pool, n in zip(pools, split_traces(p["n_traces"], [len(pool) // turns for pool in pools])):
        if n == 0:
            continue
        sources = select_sources(pool, n * turns, seed)
        traces += [build_trace(tokenizer, sources[i * turns:(i + 1) * turns], max_doc_tokens=p["max_doc_tokens"])
                   for i in range(n)]
    return traces


def query_text(tokenizer, messages: Sequence[dict], question: str) -> str:
    """The query after a turn's prompt: the question as a user message and the generation prompt (the template's
    rendering of both after the prompt's segments)."""
    full = chat_segments(tokenizer, [*messages, {"role": "user", "content": f"Question: {question}"}],
                         add_generation_prompt=True)
    return "".join(full[len(chat_segments(tokenizer, messages)):])


# ---------------------------------------------------------------------------------------------------------------------
# Running a trace


def _region(rec) -> str:
    if rec.stale_rows == 0:
        return "append"
    return "first half" if rec.first_change < rec.previous_tokens / 2 else "second half"


def run_trace(lm: LoadedModel, trace: Mapping[str, Any], paths: Sequence[TracePath], *, executor: str = "packed",
              max_new_tokens: int = 8, seed: int = 0) -> list[dict]:
    """Follow one trace's prompts with every path; one row per (turn, path).

    Turn 0 is the first prefill (every path prefills the prompt whole). Where the first change lies is measured in the
    cached prompt (the previous turn's): ``first_change_frac`` = first change / previous tokens, and ``region`` is
    ``"append"`` (no cached row after it), ``"first half"`` or ``"second half"`` of the cached prompt. Per turn each
    path, one request at a time, syncs its session to the turn's prompt and forwards the turn's question after it
    (:meth:`~sur_lab.session.EditSession.forward_query`), both timed: TTFT = sync + query forward, ms, a per-request
    latency. The rest of the greedy answers (a quality endpoint) is then decoded for all paths together from those
    query forwards (:meth:`sur_lab.answer.AnswerBatch.queried`; ``answer_batch`` rows): each first token is the
    unbatched one, later tokens equal an unbatched decode up to a batched forward's rounding. Re-prefill's answer is
    the reference the others are scored against.

    Returns:
        Rows with ``trace, turn, edits, path, method, budget_pct, sync_path, tokens, first_change, first_change_frac,
        region, deleted, inserted, reused, rerotated, recomputed, stale_rows, allowance, sync_ms, query_ms, ttft_ms,
        answer_batch, kind, known, plan_format, prediction, em, agree, token_exact, debt``: ``kind``, ``known`` and
        ``plan_format`` are the turn's question kind, whether its gold is an answer (not "unknown") and whether the
        revised plan's answer format is in force (:func:`build_trace`); ``em`` is normalized exact match against the
        turn's gold (:func:`~sur_lab.analysis.scoring.exact_match`; the format prefix and "unknown" are part of it).

    Raises:
        ValueError: naming ``paths`` when re-prefill is missing or labels repeat.
    """
    labels = [p.label for p in paths]
    if REFERENCE not in labels or len(set(labels)) != len(labels):
        raise ValueError(f"paths must have unique labels and include {REFERENCE!r}; got {labels}")
    order = sorted(paths, key=lambda p: p.label != REFERENCE)
    sessions = {p.label: EditSession(lm, method=p.method, budget_pct=0.0 if math.isnan(p.budget_pct) else p.budget_pct,
                                     executor=executor, seed=seed, sync_policy=p.policy) for p in paths}
    rows = []
    for t, turn in enumerate(trace["turns"]):
        query = query_text(lm.tokenizer, turn["messages"], turn["question"])
        query_ids = torch.tensor(lm.tokenizer(query, add_special_tokens=False)["input_ids"], dtype=torch.long)
        synced, caches, firsts = [], [], []
        for p in order:  # one request at a time: the sync and the query forward are timed per request (TTFT)
            session = sessions[p.label]
            t0 = time.perf_counter()
            rec = session.sync(turn["messages"])
            sync_ms = (time.perf_counter() - t0) * 1e3
            first, cache = session.forward_query(query_ids)
            synced.append((p, rec, sync_ms, first.timings_ms["query"], session.debt))
            caches.append(cache)
            firsts.append(first.first_token_logits)
        # The rest of the answers is a quality endpoint: decoded together from the per-request query forwards.
        answers = AnswerBatch.queried(lm, caches, query_ids, torch.stack(firsts), copy=False).decode(max_new_tokens)
        ref = answers[0]  # re-prefill's (first in ``order``)
        ref_parsed = extract_answer(ref.text)
        for (p, rec, sync_ms, query_ms, debt), ans in zip(synced, answers):
            prediction = extract_answer(ans.text)
            rows.append({
                "trace": trace["id"], "turn": t, "edits": turn["edits"], "path": p.label, "method": p.method,
                "budget_pct": p.budget_pct, "sync_path": rec.path, "tokens": rec.num_tokens,
                "first_change": rec.first_change, "first_change_frac": rec.first_change / max(1, rec.previous_tokens),
                "region": _region(rec) if t else "prefill", "deleted": rec.deleted, "inserted": rec.inserted,
                "reused": rec.reused, "rerotated": rec.rerotated, "recomputed": rec.recomputed,
                "stale_rows": rec.stale_rows, "allowance": rec.allowance, "sync_ms": sync_ms,
                "query_ms": query_ms, "ttft_ms": sync_ms + query_ms, "answer_batch": len(answers),
                "kind": turn.get("kind", "new"), "known": bool(turn.get("known", True)),
                "plan_format": bool(turn.get("format", False)),
                "prediction": prediction, "em": bool(exact_match(prediction, turn["answers"])),
                "agree": bool(agreement(prediction, ref_parsed)),
                "token_exact": list(ans.token_ids) == list(ref.token_ids), "debt": debt,
            })
    return rows


def run_traces(lm: LoadedModel, traces: Sequence[Mapping[str, Any]], paths: Sequence[TracePath], *,
               executor: str = "packed", max_new_tokens: int = 8, seed: int = 0, progress: bool = True) -> pd.DataFrame:
    """:func:`run_trace` over ``traces``; one DataFrame with cumulative cost columns.

    Added columns: ``cum_recomputed`` and ``cum_ttft_ms`` (sums over the trace's turns so far, the first prefill
    included) and ``cost_ratio`` (cumulative tokens recomputed over re-prefill's at the same turn).
    """
    rows = []
    for trace in tqdm(traces, desc="traces", disable=not progress):
        rows += run_trace(lm, trace, paths, executor=executor, max_new_tokens=max_new_tokens, seed=seed)
    return add_cumulative(pd.DataFrame(rows))


def add_cumulative(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``cum_recomputed``, ``cum_ttft_ms`` and ``cost_ratio`` (see :func:`run_traces`)."""
    df = df.copy()
    grouped = df.groupby(["trace", "path"], sort=False)
    df["cum_recomputed"] = grouped["recomputed"].cumsum()
    df["cum_ttft_ms"] = grouped["ttft_ms"].cumsum()
    ref = df[df["path"] == REFERENCE].set_index(["trace", "turn"])["cum_recomputed"]
    df["cost_ratio"] = df["cum_recomputed"].to_numpy() / ref.loc[list(zip(df["trace"], df["turn"]))].to_numpy()
    return df


# ---------------------------------------------------------------------------------------------------------------------
# The study: declarations on the Study base (issue 39); the parameters' checks, the trace part files


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


def _fingerprint(lm, p: Mapping[str, Any], seed: int, executor: str) -> dict:
    """What every stored row depends on besides its trace (:meth:`sur_lab.sweeps.SweepStore.run_keyed`)."""
    return {**model_fingerprint(lm), "params": dict(p), "seed": int(seed), "executor": executor,
            "versions": versions()}


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
        :func:`kind_table`) and the conclusion lines (:func:`conclusion`, on the 5 % sync path when it ran, else the
        first budget's)."""
        budgets = p["budgets"]
        lead = f"sync {5 if 5 in budgets else budgets[0]:g}%"
        summary, regions, kinds = summary_table(runs), region_table(runs), kind_table(runs)
        return Report(tables={"summary": summary, "regions": regions, "kinds": kinds},
                      conclusion=conclusion(regions, summary, runs, sync=lead, kinds=kinds, decide=decide))

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


# ---------------------------------------------------------------------------------------------------------------------
# Tables, figures and the conclusion


def per_turn_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (path, turn) over traces: median TTFT, mean tokens recomputed, EM and agreement (%), mean cumulative cost
    (tokens recomputed and TTFT) and its ratio to re-prefill's."""
    out = runs.groupby(["path", "turn"], sort=False).agg(
        n=("em", "size"), ttft_ms=("ttft_ms", "median"), recomputed=("recomputed", "mean"), em_pct=("em", "mean"),
        agree_pct=("agree", "mean"), cum_recomputed=("cum_recomputed", "mean"), cum_ttft_ms=("cum_ttft_ms", "mean"),
        cost_ratio=("cost_ratio", "mean"),
    ).reset_index()
    out[["em_pct", "agree_pct"]] *= 100
    return out


def _groups(runs: pd.DataFrame, by: str) -> list[tuple[str, pd.DataFrame]]:
    """The later turns of ``runs`` split by ``by``: per region (:data:`REGIONS`) or per question kind
    (:data:`QUESTION_KINDS`, then ``"reaching"``: every kind but ``new``), then ``"all"``; empty groups left out."""
    later = runs[runs["turn"] > 0]
    names = REGIONS if by == "region" else QUESTION_KINDS
    groups = [(g, later[later[by] == g]) for g in names]
    if by == "kind":
        groups.append(("reaching", later[later["kind"].isin(REACHING)]))
    groups.append(("all", later))
    return [(g, part) for g, part in groups if not part.empty]


def comparison_table(runs: pd.DataFrame, by: str = "region", *, against: str = PREFIX, clustered: bool = True,
                     seed: int = 0, n_boot: int = 2_000) -> pd.DataFrame:
    """Per (group of later turns, path), each path paired with ``against`` on the same turns: median TTFT, the paired
    speed-up ``against``'s TTFT / this path's (geometric mean, > 1: this path is faster) with its 95 % percentile
    bootstrap interval (NaN with one cluster or identical ratios), median tokens recomputed, agreement with re-prefill
    and EM (%), the paired difference of agreement against ``against`` (``agree_delta``, ``agree_delta_low``,
    ``agree_delta_high``, in percentage points: :func:`sur_lab.analysis.decisions.in_units`; Newcombe's interval,
    hulled with the cluster bootstrap's), and the turns on which this path loses re-prefill's answer that ``against`` kept
    (``losses``) with the exact 95 % upper bound of that rate (``loss_upper_pct``). Descriptive: the verdicts are
    :func:`conclusion`'s.

    Args:
        runs: the per-turn rows (:func:`run_traces`; ``kind`` needed when ``by="kind"``).
        by: ``"region"`` (where the first change lands) or ``"kind"`` (the question kind, plus ``"reaching"``).
        against: the path every other is paired with.
        clustered: ``True``: a trace's turns resampled together (:func:`sur_lab.analysis.decisions.paired_family`'s
            ``cluster``); ``False``: turns as independent units (for comparison only: they are not).
        seed, n_boot: the bootstrap's.

    Raises:
        ValueError: naming ``by`` when not ``"region"`` or ``"kind"``, ``against`` when it is not a path of ``runs``.
    """
    if by not in ("region", "kind"):
        raise ValueError(f"by={by!r} must be 'region' or 'kind'")
    if against not in set(runs["path"]):
        raise ValueError(f"against={against!r} is not a path of runs; paths: {sorted(set(runs['path']))}")
    rows = []
    nan = float("nan")
    for group, part in _groups(runs, by):
        wide = part.pivot_table(index=["trace", "turn"], columns="path", values=["ttft_ms", "agree"], aggfunc="first")
        traces = wide.index.get_level_values("trace").to_numpy() if clustered else None
        for path in dict.fromkeys(part["path"]):
            mine = part[part["path"] == path]
            a_agree = wide["agree"][path].astype(float).to_numpy()
            b_agree = wide["agree"][against].astype(float).to_numpy()
            losses = int(np.sum((b_agree == 1) & (a_agree == 0)))
            row = {by: group, "path": path, "turns": len(mine), "ttft_ms": mine["ttft_ms"].median(),
                   "speedup": 1.0, "speedup_lo": nan, "speedup_hi": nan, "recomputed": mine["recomputed"].median(),
                   "agree_pct": 100 * mine["agree"].mean(), "agree_delta": 0.0, "agree_delta_low": nan,
                   "agree_delta_high": nan, "losses": losses,
                   "loss_upper_pct": 100 * proportion_interval(losses, len(a_agree))[2],
                   "em_pct": 100 * mine["em"].mean()}
            if path != against:
                ratio = paired_family({(path, against): (wide["ttft_ms"][path].to_numpy(float),
                                                         wide["ttft_ms"][against].to_numpy(float))},
                                      kind="ratio", cluster=traces, n_boot=n_boot, seed=seed).iloc[0]
                agree = in_units(paired_family({(path, against): (a_agree, b_agree)}, kind="binary",
                                               cluster=traces, n_boot=n_boot, seed=seed)).iloc[0]
                row.update(speedup=ratio["estimate"], speedup_lo=ratio["ci_low"], speedup_hi=ratio["ci_high"],
                           agree_delta=agree["delta"], agree_delta_low=agree["delta_low"],
                           agree_delta_high=agree["delta_high"])
            rows.append(row)
    return pd.DataFrame(rows)


def region_table(runs: pd.DataFrame, *, against: str = PREFIX, clustered: bool = True, seed: int = 0,
                 n_boot: int = 2_000) -> pd.DataFrame:
    """:func:`comparison_table` by region of the first change (:data:`REGIONS`, then ``"all"``).

    Raises:
        ValueError: naming ``against`` when it is not a path of ``runs``.
    """
    return comparison_table(runs, "region", against=against, clustered=clustered, seed=seed, n_boot=n_boot)


def kind_table(runs: pd.DataFrame, *, against: str = PREFIX, clustered: bool = True, seed: int = 0,
               n_boot: int = 2_000) -> pd.DataFrame:
    """:func:`comparison_table` by question kind (:data:`QUESTION_KINDS`, then ``"reaching"``, then ``"all"``), with
    ``known_pct``: the share of the group's turns whose gold is an answer rather than "unknown".

    Raises:
        ValueError: naming ``against`` when it is not a path of ``runs``.
    """
    out = comparison_table(runs, "kind", against=against, clustered=clustered, seed=seed, n_boot=n_boot)
    known = {g: 100 * part.drop_duplicates(["trace", "turn"])["known"].mean() for g, part in _groups(runs, "kind")}
    out.insert(3, "known_pct", out["kind"].map(known))
    return out


def summary_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per path over every turn after the first: median TTFT, agreement and EM (%), and over whole traces the total
    tokens recomputed and TTFT and their ratio to re-prefill's (means over traces)."""
    later = runs[runs["turn"] > 0]
    quality = later.groupby("path", sort=False).agg(turns=("em", "size"), ttft_ms=("ttft_ms", "median"),
                                                    agree_pct=("agree", "mean"), em_pct=("em", "mean"))
    quality[["agree_pct", "em_pct"]] *= 100
    last = runs[runs["turn"] == runs.groupby("trace")["turn"].transform("max")]
    total = last.groupby("path", sort=False).agg(total_recomputed=("cum_recomputed", "mean"),
                                                 total_ttft_ms=("cum_ttft_ms", "mean"), cost_ratio=("cost_ratio", "mean"))
    ref_ms = total.loc[REFERENCE, "total_ttft_ms"] if REFERENCE in total.index else float("nan")
    total["time_ratio"] = total["total_ttft_ms"] / ref_ms
    return quality.join(total).reset_index()


def _styles(paths: Sequence[str]) -> dict:
    return {p: {"color": f"C{i}", "marker": "os^vDP*X"[i % 8]} for i, p in enumerate(paths)}


def plot_cost_agreement(table: pd.DataFrame):
    """Per turn: cumulative tokens recomputed (left, log), cumulative TTFT (middle, log) and agreement with
    re-prefill (right), one line per path (``table``: :func:`per_turn_table`)."""
    paths = list(dict.fromkeys(table["path"]))
    style = _styles(paths)
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), sharex=True)
    panels = ((axes[0], "cum_recomputed", "cumulative tokens recomputed", True),
              (axes[1], "cum_ttft_ms", "cumulative time to first token (ms)", True),
              (axes[2], "agree_pct", "agreement with re-prefill (%)", False))
    for ax, col, label, log in panels:
        for path in paths:
            t = table[table["path"] == path]
            ax.plot(t["turn"], t[col], label=path, lw=1.4, ms=5, **style[path])
        ax.set_xlabel("turn (0: first prefill)")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(-3, 103)
    axes[2].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def _plot_groups(table: pd.DataFrame, by: str, names: Sequence[str], xlabel: str, panels: Sequence[tuple[str, str]]):
    paths = list(dict.fromkeys(table["path"]))
    names = [g for g in names if g in set(table[by])]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.8))
    width = 0.8 / max(1, len(paths))
    for i, path in enumerate(paths):
        t = table[table["path"] == path].set_index(by).reindex(names)
        x = np.arange(len(names)) + i * width
        for ax, (col, _) in zip(axes, panels):
            ax.bar(x, t[col], width, label=path, color=f"C{i}")
    for ax, (col, label) in zip(axes, panels):
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        if col.endswith("_pct"):
            ax.set_ylim(0, 105)
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def plot_regions(regions: pd.DataFrame):
    """Median TTFT (left) and agreement with re-prefill (right) per region of the first change, one bar per path
    (``regions``: :func:`region_table`)."""
    return _plot_groups(regions, "region", (*REGIONS, "all"), "first change of the turn",
                        (("ttft_ms", "median time to first token (ms)"),
                         ("agree_pct", "agreement with re-prefill (%)")))


def plot_kinds(kinds: pd.DataFrame):
    """Agreement with re-prefill (left) and EM (right) per question kind, one bar per path (``kinds``:
    :func:`kind_table`)."""
    return _plot_groups(kinds, "kind", (*QUESTION_KINDS, "reaching", "all"), "question kind",
                        (("agree_pct", "agreement with re-prefill (%)"), ("em_pct", "exact match (%)")))


def _later_wide(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The later turns as one row per (trace, turn) with a column per (endpoint, path), and the turns' region and
    kind aligned with it."""
    later = runs[runs["turn"] > 0]
    wide = later.pivot_table(index=["trace", "turn"], columns="path", values=["ttft_ms", "agree"], aggfunc="first")
    meta = later.drop_duplicates(["trace", "turn"]).set_index(["trace", "turn"])[["region", "kind"]].reindex(
        wide.index)
    return wide, meta


def primary_table(runs: pd.DataFrame, *, sync: str = "sync 5%", clustered: bool = True, decide: bool = True,
                  n_boot: int = 10_000, seed: int = 0) -> pd.DataFrame:
    """The declared comparisons, decided (:func:`sur_lab.analysis.decisions.paired_family` rows, in this order):
    :data:`PRIMARY` (prefix reuse's TTFT over ``sync``'s on every later turn, tested alone), :data:`AGREEMENT_FAMILY`
    (``sync`` − prefix reuse, agreement with re-prefill on the later turns of a :data:`REACHING` kind, equivalence
    within :data:`AGREEMENT_MARGIN`), :data:`KIND_FAMILY` (the same per question kind, Holm) and
    :data:`REGION_FAMILY` (the TTFT ratio per region of the first change, Holm).

    Args:
        runs: the per-turn rows (:func:`run_traces`).
        sync: the lead sync path.
        clustered: ``True`` (the declared analysis): a trace's turns are one cluster, resampled together by the
            bootstrap and flipped together by the sign tests; ``False``: turns as independent units (for comparison
            only).
        decide: ``False`` at a plumbing-check size (``decisions.decides(preset)``).
        n_boot, seed: as :func:`~sur_lab.analysis.decisions.paired_family`.

    Raises:
        ValueError: naming ``sync`` when it is not a path of ``runs``.
    """
    if sync not in set(runs["path"]):
        raise ValueError(f"sync={sync!r} is not a path of runs; paths: {sorted(set(runs['path']))}")
    wide, meta = _later_wide(runs)
    traces = wide.index.get_level_values("trace").to_numpy()
    kw = dict(decide=decide, n_boot=n_boot, seed=seed)

    def agree(mask):
        return (wide["agree"][sync].astype(float).to_numpy()[mask],
                wide["agree"][PREFIX].astype(float).to_numpy()[mask])

    def times(mask):
        return wide["ttft_ms"][sync].to_numpy(float)[mask], wide["ttft_ms"][PREFIX].to_numpy(float)[mask]

    def family(fam, masks, data, label):
        keys = {g: (f"{sync}{label(g)}", f"{PREFIX}{label(g)}") for g in masks}
        cluster = {keys[g]: traces[m] for g, m in masks.items()} if clustered else None
        return paired_family({keys[g]: data(m) for g, m in masks.items()}, family=fam, cluster=cluster, **kw)

    reaching = meta["kind"].isin(REACHING).to_numpy()
    kinds = {k: (meta["kind"] == k).to_numpy() for k in QUESTION_KINDS if (meta["kind"] == k).any()}
    regions = {r: (meta["region"] == r).to_numpy() for r in REGIONS if (meta["region"] == r).any()}
    tables = [family(PRIMARY, {"all": np.ones(len(wide), dtype=bool)}, times, lambda g: "")]
    if reaching.any():
        tables.append(family(AGREEMENT_FAMILY, {"reaching": reaching}, agree, lambda g: " (reaching questions)"))
    if kinds:
        tables.append(family(KIND_FAMILY, kinds, agree, lambda g: f" ({g})"))
    if regions:
        tables.append(family(REGION_FAMILY, regions, times, lambda g: f" ({g})"))
    return pd.concat(tables, ignore_index=True)


def conclusion(regions: pd.DataFrame, summary: pd.DataFrame, runs: pd.DataFrame, *, sync: str = "sync 5%",
               kinds: pd.DataFrame | None = None, max_agreement_loss: float = MAX_AGREEMENT_LOSS, decide: bool = True,
               n_boot: int = 10_000, seed: int = 0) -> list[str]:
    """The conclusion's sentences from this run's tables, with every verdict from :mod:`sur_lab.analysis.decisions`:
    per region of the first change the path with the lowest median TTFT (a point estimate, the selection named) and
    ``sync``'s numbers against prefix reuse; per question kind ``sync``'s, Shift's and prefix reuse's agreement with
    re-prefill and EM; the declared comparisons (:func:`primary_table`: the primary, whether ``sync`` is faster than
    prefix reuse over every later turn; whether it keeps re-prefill's answers on the reaching questions as prefix
    reuse does, within the margin, and the same per kind; the speed-up by region); per region whether ``sync`` is
    shown to lose at most ``max_agreement_loss`` of agreement (:func:`~sur_lab.analysis.decisions.bound_claim` on its
    loss turns); and where ``sync`` should not be used (prefix reuse shown faster, or a loss above the tolerance shown)
    or where this size shows neither.

    Args:
        regions: :func:`region_table`; summary: :func:`summary_table`; runs: the per-turn rows behind them.
        sync: the lead sync path.
        kinds: :func:`kind_table` (default: computed from ``runs``).
        max_agreement_loss: the agreement loss tolerated by the per-region bounds, a fraction in [0, 1].
        decide: ``False`` at a plumbing-check size (``decisions.decides(preset)``).
        n_boot, seed: as :func:`sur_lab.analysis.decisions.paired_family`.

    Raises:
        ValueError: naming ``sync`` when it is not a path of the tables, ``max_agreement_loss`` outside [0, 1].
    """
    if sync not in set(regions["path"]):
        raise ValueError(f"sync={sync!r} is not a path of the tables; paths: {sorted(set(regions['path']))}")
    if not 0 <= max_agreement_loss <= 1:
        raise ValueError(f"max_agreement_loss={max_agreement_loss!r} must lie in [0, 1]")

    def interval(lo: float, hi: float, fmt: str, sep: str, unit: str = "") -> str:
        return ("no interval" if math.isnan(lo) or math.isnan(hi) else
                f"95 % CI {lo:{fmt}}{unit}{sep}{hi:{fmt}}{unit}")

    lines = []
    present = [r for r in (*REGIONS, "all") if r in set(regions["region"])]
    for region in present:
        t = regions[regions["region"] == region].set_index("path")
        fastest = t["ttft_ms"].idxmin()
        s = t.loc[sync]
        lines.append(
            f"{region} ({int(s.turns)} turn{'s' if int(s.turns) != 1 else ''}): lowest median TTFT of the {len(t)} "
            f"paths {fastest} ({t.loc[fastest, 'ttft_ms']:.0f} ms; point estimates); {sync} {s.ttft_ms:.0f} ms, "
            f"{s.speedup:.2f}x prefix reuse's speed (paired geometric mean, "
            f"{interval(s.speedup_lo, s.speedup_hi, '.2f', ' to ', 'x')}), re-prefill "
            f"{t.loc[REFERENCE, 'ttft_ms']:.0f} ms; agreement with re-prefill {s.agree_pct:.0f} % vs prefix reuse {t.loc[PREFIX, 'agree_pct']:.0f} % "
            f"({s.agree_delta:+.0f} pp, {interval(s.agree_delta_low, s.agree_delta_high, '+.0f', ' to ')}); "
            f"tokens recomputed {s.recomputed:.0f} vs {t.loc[PREFIX, 'recomputed']:.0f} (medians).")
    if "kind" in runs.columns:
        kt = kinds if kinds is not None else kind_table(runs, seed=seed, n_boot=min(n_boot, 2_000))
        for kind in [k for k in (*QUESTION_KINDS, "reaching") if k in set(kt["kind"])]:
            t = kt[kt["kind"] == kind].set_index("path")
            shift = f", {SHIFT} {t.loc[SHIFT, 'agree_pct']:.0f} %" if SHIFT in t.index else ""
            lines.append(
                f"{kind} questions ({int(t.loc[sync, 'turns'])} turns, gold known on {t.loc[sync, 'known_pct']:.0f} "
                f"%): agreement with re-prefill {sync} {t.loc[sync, 'agree_pct']:.0f} %{shift}, prefix reuse "
                f"{t.loc[PREFIX, 'agree_pct']:.0f} %; EM re-prefill {t.loc[REFERENCE, 'em_pct']:.0f} %, {sync} "
                f"{t.loc[sync, 'em_pct']:.0f} %.")
    decided = primary_table(runs, sync=sync, decide=decide, n_boot=n_boot, seed=seed)
    lines += family_lines(decided, what="turns", clusters="traces")
    wide, meta = _later_wide(runs)
    fam = decided[decided["family"] == REGION_FAMILY.name]
    by_region = [r for r in REGIONS if (meta["region"] == r).any()]
    avoid, unshown, ok = [], [], []
    limit = f"{100 * max_agreement_loss:g} points"
    for region, (_, r) in zip(by_region, fam.iterrows()):
        mask = (meta["region"] == region).to_numpy()
        a_agree = wide["agree"][sync].astype(float).to_numpy()[mask]
        b_agree = wide["agree"][PREFIX].astype(float).to_numpy()[mask]
        losses = int(np.sum((b_agree == 1) & (a_agree == 0)))
        loss = bound_claim(losses, len(a_agree), at_most=max_agreement_loss, decide=decide)
        lines.append(f"  {region}: " + bound_sentence(f"{sync} loses re-prefill's answer that prefix reuse kept on",
                                                      losses, len(a_agree), at_most=max_agreement_loss,
                                                      decide=decide, units="turns"))
        if r["verdict"] == LOSES:
            avoid.append(f"{region}: prefix reuse is shown faster ({r['estimate']:.2f}x)")
        if loss == FAILS:
            avoid.append(f"{region}: a loss of agreement above {limit} is shown")
        if r["verdict"] == BEATS and loss == HOLDS:
            ok.append(region)
        elif r["verdict"] != LOSES and loss != FAILS:
            unshown.append(region)
    if not decide:
        lines.append("Where to use the sync path: not decided at this size (a plumbing check).")
        return lines + _whole_trace_lines(summary)
    if avoid:
        lines.append(f"Where {sync} should not be used: " + "; ".join(avoid) + ".")
    if ok:
        lines.append(f"{sync} is shown faster than prefix reuse and shown to lose at most {limit} of agreement in: "
                     + ", ".join(ok) + ".")
    if unshown:
        lines.append(f"Not shown at this size (faster, or within {limit} of agreement) in: " + ", ".join(unshown)
                     + ".")
    return lines + _whole_trace_lines(summary)


def _whole_trace_lines(summary: pd.DataFrame) -> list[str]:
    """Whole-trace cost and quality per path against re-prefill (descriptive)."""
    sm = summary.set_index("path")
    return [f"over whole traces {path}: {r.cost_ratio:.0%} of re-prefill's tokens recomputed, {r.time_ratio:.0%} of "
            f"its summed TTFT; agreement {r.agree_pct:.0f} %, EM {r.em_pct:.0f} % (re-prefill EM "
            f"{sm.loc[REFERENCE, 'em_pct']:.0f} %)." for path, r in sm.iterrows() if path != REFERENCE]
