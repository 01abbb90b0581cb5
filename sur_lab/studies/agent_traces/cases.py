"""Notebook 10's traces: the prompts an agent runtime resends every turn, built from the QA development files (the
edits and the question kinds are the package docstring's, :mod:`sur_lab.studies.agent_traces`).

The fixed messages (:data:`SYSTEM`, :data:`TASK`, :data:`PLAN`, the rewrite :data:`REWRITTEN` and its
:data:`FORMAT_PREFIX`), the question kinds (:data:`QUESTION_KINDS`, :func:`question_kinds`, :data:`REACHING`), the gold
of a lost answer (:data:`UNKNOWN`, :func:`reachable`), one trace (:func:`build_trace`), a study's traces
(:func:`build_traces`, split over :data:`TRACE_DATASETS` by :func:`split_traces`) and the query after a turn's prompt
(:func:`query_text`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sur_lab.analysis.scoring import NONE_PREDICTIONS, normalize_answer
from sur_lab.data.qa import QAExample, load_qa, select_sources
from sur_lab.data.text import passage_block
from sur_lab.edits import chat_segments

__all__ = ["SYSTEM", "TASK", "PLAN", "FORMAT_PREFIX", "REWRITTEN", "QUESTION_KINDS", "REACHING", "UNKNOWN",
           "TRACE_DATASETS", "question_kinds", "reachable", "build_trace", "split_traces", "build_traces", "query_text"]

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
    """One trace: a turn per source question, with the edits and the question kinds of the package docstring
    (:mod:`sur_lab.studies.agent_traces`).

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
