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
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from sur_lab.analysis.decisions import Family, PowerBasis, PowerDesign
from sur_lab.data.text import char_token_span, join_blocks
from sur_lab.edits import (
    EditedContext,
    build_edit,
    chat_cuts,
    render_chat,
    replacement_edit,
    segment_edit,
    tokenize_segments,
)
from sur_lab.studies.base import Report, Study

#: Task families: the three controls of issue 26, then the two of issue 40 whose answer-bearing text lies downstream
#: of the edit and depends on the edited value (:data:`DERIVED_FAMILIES`).
FAMILIES = ("value_update", "superseded_tool_output", "multi_key", "derived_record", "agent_note")
#: Families whose answer-bearing text is a later block that refers to the edited value without restating it (a
#: derived record, an agent note written after the tool output): their states were computed while the old value was
#: visible, so they are the states that can carry a stale answer (issue 40).
DERIVED_FAMILIES = ("derived_record", "agent_note")
#: Exploratory families, built on request (``families=``) but not in the study's roster (:data:`FAMILIES`):
#: ``rebound_reference`` re-points a derived record from one service to another, and both services' value records
#: follow it, so the answer-bearing states were computed while the old reference was visible and the stale value is
#: in the suffix. It was tried for issue 40's reachability check (``scripts/stale_facts_probe.py --families
#: rebound_reference``); on the study model the answer did not follow the reference under any arm, Dirty included, so
#: it cannot tell a stale state from a misread one and is not a study family.
REBOUND_FAMILIES = ("rebound_reference",)
#: Every family :func:`build_stale_case` builds.
ALL_FAMILIES = FAMILIES + REBOUND_FAMILIES
#: The three families of issue 26, kept as controls: their answer-bearing text is the inserted block or an untouched
#: block, so every arm but Dirty sees the answer in clean states.
CONTROL_FAMILIES = ("value_update", "superseded_tool_output", "multi_key")
#: Answer classes of :func:`classify_answer`.
ANSWER_CLASSES = ("correct", "stale", "mixed", "distractor", "wrong")
#: Reference operators of the study (issue 26): the four of the paper and Erratum.
STUDY_REFERENCES = ("Dirty", "Shift", "Replay", "Re-prefill", "Erratum")
#: Allocators of the study (issue 26). "Edit-local window" and "Edit-local + SUR" are registered by another module.
STUDY_ALLOCATORS = (
    "SUR", "SUR-IDF", "Max-relevance contiguous", "Edit-local window", "Edit-local + SUR", "Dense tokens",
    "Random semantic units",
)


@dataclass(frozen=True)
class StaleTemplates:
    """The study's prompt wording (one source of defaults; every field is a ``str.format`` template).

    Attributes:
        instruction: placed before the documents (the user message's head).
        fact: a fact block; fields ``{key}``, ``{value}``.
        tool_output: a tool-output block (superseded tool output family); fields ``{key}``, ``{value}``, ``{call}``.
        question: the question (SUR's relevance query); field ``{key}``.
        answer_prefix: appended after the chat template's generation prompt; field ``{key}``. The value follows it
            after one space, so the first answer token is the first token of ``" " + value``.
        derived: the derived record (``derived_record``): a later line that refers to the edited key's value without
            restating it; fields ``{derived}`` (the derived service, the asked key) and ``{key}`` (the edited one),
            and optionally ``{values}`` (the inventory's shuffled list, for a wording that names the candidates in
            the derived block itself; the default does not).
        note: the agent note (``agent_note``) written after the tool output, naming no value; field ``{key}`` (and
            optionally ``{values}``, as ``derived``).
        note_question, note_answer_prefix: the ``agent_note`` question and answer prefix (about the note's plan);
            field ``{key}``.
        inventory: an earlier tool output listing the case's values (the old one among them, in another role) in
            the two derived families; field ``{values}`` (comma-separated).
    """

    instruction: str = (
        "You are an operations agent. Your notes below mix reference documents with service records and tool "
        "outputs. Answer the question using the notes. Reply with the value only."
    )
    fact: str = "Service record: the deploy target for service {key} is {value}."
    tool_output: str = "Tool output ({call}): get_deploy_target for service {key} returned the deploy target {value}."
    question: str = "What is the current deploy target for service {key}?"
    answer_prefix: str = "The current deploy target for service {key} is"
    derived: str = ("Service record: service {derived} is the canary of service {key} and always uses the same deploy "
                    "target as service {key}.")
    note: str = ("Agent note: I read the tool output for service {key} and planned the rollout: the release of service "
                 "{key} goes to the deploy target that get_deploy_target returned.")
    note_question: str = "Which deploy target does the release of service {key} go to?"
    note_answer_prefix: str = "The release of service {key} goes to the deploy target"
    inventory: str = "Tool output (call 0): list_deploy_targets returned {values}."


#: The default wording.
DEFAULT_TEMPLATES = StaleTemplates()

#: Service names (keys) and deploy-target stems (values ``"{stem}-{NN}"``). Stems start with distinct words so that
#: two values of a case rarely share a first token; construction checks it on the case's tokenizer.
SERVICES = (
    "billing", "checkout", "ledger", "inventory", "search", "payments", "gateway", "catalog", "identity", "shipping",
    "pricing", "reporting", "scheduler", "telemetry", "notifier", "archive", "profile", "storage", "recommender",
    "invoicing", "auth", "metrics", "orders", "wallet",
)
TARGET_STEMS = (
    "atlas", "boreal", "cobalt", "dorado", "ember", "fjord", "granite", "helios", "indigo", "juniper", "krypton",
    "lumen", "meridian", "nimbus", "onyx", "polaris", "quasar", "redwood", "sierra", "tundra", "umbra", "vertex",
    "willow", "zenith",
)
#: Tool-call labels of the two tool outputs (earlier, later).
TOOL_CALLS = ("call 1", "call 2")
#: Filler paragraphs that would take the prompt past ``context_len · (1 + LENGTH_SLACK)`` are skipped.
LENGTH_SLACK = 0.05

#: Study sizes by preset (:func:`sur_lab.studies.presets.resolve_preset`). ``smoke`` exercises every compared arm and
#: every family on SmolLM2 (plumbing only). ``default`` runs the Qwen study model on 48 cases (9 or 10 per family of
#: the five; the sizes of issue 26, not yet resized for issue 40's families) at 2 % and 5 % with the issue's method
#: list; its context length is sized from the CPU time of one case
#: (``scripts/stale_facts_probe.py --time`` measured about 54 s of CPU per 524-token case; 384 tokens keeps 48 cases
#: within 40 min by an estimate that scales that time with the context length, with a fifth of it held fixed for
#: decoding and overheads). ``paper`` is 432 cases (two
#: replicates of the 3 x 2 x 3 x 3 x 4 factorial) over 1K-8K at 2, 5 and 10 %, on Ray or a GPU.
PRESETS = {
    "smoke": {"context_lens": [256], "num_cases": 5, "edit_depths": [0.3], "distances": [0.3], "num_keys": 3,
              "budgets": [5], "max_new_tokens": 6,
              "allocators": ["SUR", "SUR-IDF", "Edit-local window", "Edit-local + SUR"]},
    "default": {"context_lens": [384], "num_cases": 48, "edit_depths": [0.2, 0.5], "distances": [0.1, 0.4],
                "num_keys": 4, "budgets": [2, 5], "max_new_tokens": 8, "allocators": list(STUDY_ALLOCATORS)},
    "paper": {"context_lens": [1024, 2048, 4096, 8192], "num_cases": 432, "edit_depths": [0.1, 0.3, 0.5],
              "distances": [0.05, 0.2, 0.4], "num_keys": 4, "budgets": [2, 5, 10], "max_new_tokens": 8,
              "allocators": list(STUDY_ALLOCATORS)},
}


@dataclass(frozen=True)
class StaleCase:
    """One stale-fact case.

    Attributes:
        case_id: stable identifier (``stale-{family}-{context_len}-{index:03d}``).
        family: one of :data:`FAMILIES`.
        key: the asked service (the query's key).
        edited_key: the service whose value the edit supersedes (equals ``key`` except for a multi-key case that
            asks an untouched key).
        gold: the answer after the edit (the asked key's current value).
        old: the superseded value of ``edited_key`` (V1); the stale answer when ``key == edited_key``.
        new: the value that supersedes it (V2).
        stale_value: the answer that counts as stale (``old`` when the query asks the edited key, else ``None``).
        values: every value in the case, by key (keys of the case in order of appearance; the edited key maps to its
            old value).
        inserted_len: m, tokens at the end of the edit's prefix that the edit inserted (0 for a deletion); the
            Erratum operator reads it (:func:`sur_lab.executors.erratum`).
        context_len: requested pre-query length, tokens.
        edit_depth: requested depth of the edit (fraction of the filler tokens before it).
        distance: requested distance from the edit to the answer-bearing block (fraction of the filler tokens;
            0 when the answer-bearing text is the inserted block).
        answer_in: where the answer-bearing text is: ``"inserted"`` (the end of the prefix) or ``"suffix"``.
        answer_token_span: the gold value's token span in ``edit.edited_ids`` (``" " + gold``).
        old_token_span: the old value's token span in ``edit.original_ids`` (inside the deleted span; for
            ``rebound_reference``, its referent's record in the suffix).
        key_token_spans: every token span of ``" " + key`` in ``edit.edited_ids``.
        gold_token: the first token of ``" " + gold`` (the first answer step after the answer prefix).
        old_token: the first token of ``" " + old``.
        seed: the case's own seed.
        edit: the edit (deletion or replacement layout), with the question as relevance query.
        others: values the case names besides the keys' values (the inventory of the derived families), distractors.
        bearing_token_span: the answer-bearing text's token span in ``edit.edited_ids``: the gold value's span, or
            for :data:`DERIVED_FAMILIES` the derived record / agent note (in the suffix, downstream of the edit).
        control_edit: the Erratum placement control (issue 40; :func:`placement_control`) for a replacement: the
            same inserted block placed right before the question (a deletion of the old block from the context
            before the edit with the inserted block appended); ``None`` for a deletion.
    """

    case_id: str
    family: str
    key: str
    edited_key: str
    gold: str
    old: str
    new: str
    stale_value: str | None
    values: dict[str, str]
    inserted_len: int
    context_len: int
    edit_depth: float
    distance: float
    answer_in: str
    answer_token_span: tuple[int, int]
    old_token_span: tuple[int, int]
    key_token_spans: tuple[tuple[int, int], ...]
    gold_token: int
    old_token: int
    seed: int
    edit: EditedContext = field(repr=False)
    others: tuple[str, ...] = ()
    bearing_token_span: tuple[int, int] | None = None
    control_edit: EditedContext | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        """N, tokens of the original pre-query sequence (for a replacement: before ⊕ new ⊕ old ⊕ after)."""
        return self.edit.num_tokens

    @property
    def edit_depth_tokens(self) -> int:
        """Tokens before the edit in the edited context: the prefix ``p`` (inserted tokens included)."""
        return self.edit.prefix_len

    @property
    def answer_distance_tokens(self) -> int:
        """Tokens from the end of the edit (the suffix start ``p``) to the answer-bearing text in the edited ids
        (:attr:`bearing_token_span`; the gold value when unset); negative when it is in the prefix (the inserted
        block)."""
        span = self.bearing_token_span or self.answer_token_span
        return span[0] - self.edit.prefix_len

    @property
    def distractors(self) -> tuple[str, ...]:
        """Every case value other than the gold and the stale one (other keys' values; for an untouched-key query,
        the edited key's old and new values)."""
        every = [*self.values.values(), self.new, *self.others]
        return tuple(dict.fromkeys(v for v in every if v not in (self.gold, self.stale_value)))

    def meta(self) -> dict[str, Any]:
        """Flat scalars for sweep records (the edit's p, d and S are record fields already)."""
        return {
            "dataset": "stale-facts",
            "family": self.family,
            "context_len": self.context_len,
            "num_tokens": self.num_tokens,
            "edit_depth": self.edit_depth,
            "edit_depth_tokens": self.edit_depth_tokens,
            "distance": self.distance,
            "answer_distance_tokens": self.answer_distance_tokens,
            "answer_in": self.answer_in,
            "asks_edited_key": self.key == self.edited_key,
            "key": self.key,
            "gold_value": self.gold,
            "old_value": self.old,
            "new_value": self.new,
            "stale_value": self.stale_value or "",
            "distractor_values": ",".join(self.distractors),
            "gold_token": self.gold_token,
            "old_token": self.old_token,
            "inserted_len": self.inserted_len,
            "layout": "edit",
        }

    def sweep_case(self):
        """This case as a :class:`sur_lab.sweeps.Case` (gold = ``(gold,)``, meta = :meth:`meta`)."""
        from sur_lab.sweeps import Case

        return Case(self.case_id, self.edit, (self.gold,), self.meta())

    def control_case(self):
        """The Erratum placement control (:attr:`control_edit`) as a sweep ``Case``: case id ``{case_id}-late``,
        the case's meta with ``layout = "late"`` (the inserted block right before the question); ``None`` for a
        deletion case (no inserted block)."""
        from sur_lab.sweeps import Case

        if self.control_edit is None:
            return None
        return Case(f"{self.case_id}-late", self.control_edit, (self.gold,), {**self.meta(), "layout": "late"})


# ---------------------------------------------------------------------------------------------------------------------
# Scoring


def _mentions(text: str, value: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", text, re.IGNORECASE) is not None


def classify_answer(text: str, gold: str, stale: str | None = None, distractors: Sequence[str] = ()) -> str:
    """Classify a generated answer by the case values it names (each searched as a whole word, ignoring case).

    Args:
        text: the decoded answer (after the answer prefix); ``None`` is empty.
        gold: the current value.
        stale: the superseded value of the asked key (``None`` when the query asks an untouched key).
        distractors: the case's other values.

    Returns:
        ``"correct"`` (gold only), ``"stale"`` (the stale value, not the gold), ``"mixed"`` (gold and another value),
        ``"distractor"`` (another value only) or ``"wrong"`` (no case value).
    """
    text = text or ""
    has_gold = _mentions(text, gold)
    has_stale = stale is not None and _mentions(text, stale)
    has_other = any(_mentions(text, v) for v in distractors if v not in (gold, stale))
    if has_gold:
        return "mixed" if has_stale or has_other else "correct"
    if has_stale:
        return "stale"
    return "distractor" if has_other else "wrong"


def answer_class(case: Any, text: str) -> str:
    """:func:`classify_answer` of ``text`` with the case's values.

    Args:
        case: a :class:`StaleCase`, or its :meth:`StaleCase.sweep_case` (a sweep ``Case``: the values are read from
            its ``meta``: ``gold_value``, ``stale_value`` ("" for none) and ``distractor_values``, comma-separated).
        text: the decoded answer.
    """
    if isinstance(case, StaleCase):
        return classify_answer(text, case.gold, case.stale_value, case.distractors)
    meta = case.meta
    others = tuple(v for v in str(meta["distractor_values"]).split(",") if v)
    return classify_answer(text, meta["gold_value"], meta["stale_value"] or None, others)


def stale_fact_scorer(case: Any, text: str) -> bool:
    """Sweep scorer (EM; ``run_sweep(..., scorer=stale_fact_scorer)``): ``True`` iff the answer names the gold value
    and no other case value. ``case`` is a :class:`StaleCase` or its sweep ``Case``."""
    return answer_class(case, text) == "correct"


def is_stale_answer(case: Any, text: str) -> bool:
    """Whether the answer names the superseded value (and not the gold one): the stale-answer endpoint. ``case`` is
    a :class:`StaleCase` or its sweep ``Case``."""
    return answer_class(case, text) == "stale"


# ---------------------------------------------------------------------------------------------------------------------
# Construction


def _token_span(offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    """The token span whose characters are exactly ``[start, end)``, or ``None`` when a token crosses either end."""
    first = next((i for i, (a, b) in enumerate(offsets) if b > start), None)
    if first is None or offsets[first][0] != start:
        return None
    last = first
    while last < len(offsets) and offsets[last][1] < end:
        last += 1
    if last >= len(offsets) or offsets[last][1] != end:
        return None
    return first, last + 1


def _aligned(tokenizer, block: str, piece: str) -> bool:
    """Whether ``piece`` occurs in ``block`` as whole tokens equal to ``piece`` tokenized on its own."""
    ids, offsets = tokenize_segments(tokenizer, [block])
    alone = tokenize_segments(tokenizer, [piece])[0][0]
    start = block.find(piece)
    while start >= 0:
        span = _token_span(offsets, start, start + len(piece))
        if span is None or ids[0][span[0] : span[1]] != alone:
            return False
        start = block.find(piece, start + 1)
    return True


def _first_token(tokenizer, text: str) -> int:
    return tokenize_segments(tokenizer, [text])[0][0][0]


def _draw_values(tokenizer, rng: np.random.Generator, n: int, templates: StaleTemplates, key: str) -> list[str]:
    """``n`` values ``"{stem}-{NN}"`` with distinct stems and distinct first tokens of ``" " + value``, each a whole
    token span in a fact block, a tool-output block and an inventory list (before a comma and before the period)."""
    out: list[str] = []
    firsts: set[int] = set()
    for stem in rng.permutation(TARGET_STEMS):
        value = f"{stem}-{int(rng.integers(10, 100))}"
        first = _first_token(tokenizer, " " + value)
        if first in firsts:
            continue
        blocks = (templates.fact.format(key=key, value=value),
                  templates.tool_output.format(key=key, value=value, call=TOOL_CALLS[0]),
                  templates.inventory.format(values=f"{value}, {value}"))
        if all(_aligned(tokenizer, b, " " + value) for b in blocks):
            out.append(value)
            firsts.add(first)
        if len(out) == n:
            return out
    raise ValueError(f"cannot draw {n} values with distinct first tokens that tokenize as whole spans")


def _filler(tokenizer, corpus, rng, context_len: int, overhead: int, banned: Sequence[str]):
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    blocks, lengths, total = [], [], 0
    ceiling = context_len * (1.0 + LENGTH_SLACK)
    for idx in rng.permutation(len(corpus)):
        if total + overhead >= context_len:
            break
        p = corpus[int(idx)]
        block = f"Title: {p.title}\n{p.text.strip()}"
        n = count(block) + 1
        if total + overhead + n > ceiling or any(_mentions(block, b) for b in banned):
            # Too long for the remaining room, or it names a case key or value (an ambiguous context).
            continue
        blocks.append(block)
        lengths.append(n)
        total += n
    if total + overhead < context_len * (1.0 - LENGTH_SLACK) or not blocks:
        raise ValueError(f"corpus has too few paragraphs ({len(corpus)}) for context_len={context_len}")
    return blocks, np.asarray(lengths), total


def build_stale_case(
    tokenizer,
    corpus: Sequence[Any],
    *,
    family: str,
    context_len: int,
    edit_depth: float,
    distance: float = 0.0,
    num_keys: int = 4,
    ask_edited: bool = True,
    seed: int,
    case_id: str | None = None,
    templates: StaleTemplates = DEFAULT_TEMPLATES,
    inventory: bool = True,
) -> StaleCase:
    """Build one stale-fact case.

    Args:
        tokenizer: the target model's fast byte-level tokenizer with a chat template.
        corpus: filler paragraphs with ``title`` and ``text`` (:func:`sur_lab.data.qa.load_corpus`).
        family: one of :data:`ALL_FAMILIES` (the study's :data:`FAMILIES` or an exploratory
            :data:`REBOUND_FAMILIES` one).
        context_len: target pre-query length in tokens (>= 128); filler paragraphs are added in a seeded order until
            the prompt reaches it, skipping those that would overshoot it by more than :data:`LENGTH_SLACK` (the
            chat template's head is not counted: the prompt is a few dozen tokens longer).
        edit_depth: depth of the edited block, a fraction in [0, 1] of the filler tokens before it; the block goes to
            the paragraph boundary nearest to it.
        distance: the answer-bearing block's depth minus ``edit_depth`` (fraction of the filler tokens, > 0, with
            ``edit_depth + distance <= 1``) for ``superseded_tool_output``, the derived families (the derived record
            or agent note), ``rebound_reference`` (the two referents' value records) and a ``multi_key`` case that asks an untouched key; ignored (recorded as 0) when the
            answer-bearing text is the inserted block.
        num_keys: keys of a ``multi_key`` case (>= 2); ``derived_record`` has two (the edited and the derived
            service), ``rebound_reference`` three (the asked service, whose record the edit re-points, and its old
            and new referents), other families one.
        ask_edited: for ``multi_key``, ask the updated key (True) or an untouched one (False).
        seed: seed for keys, values and filler order.
        case_id: identifier (default ``stale-{family}-{context_len}-s{seed}``).
        templates: the prompt wording.
        inventory: for :data:`DERIVED_FAMILIES`, place the inventory tool output (every case value, shuffled) at
            half the edit's depth, upstream of it (default); ignored by the other families.

    Returns:
        StaleCase whose ``edit`` deletes the superseded block (``superseded_tool_output``) or replaces it by the new one
        (the other families; :func:`sur_lab.edits.replacement_edit`), with its placement control for a replacement.

    Raises:
        ValueError: naming ``family``, ``context_len``, ``edit_depth``, ``distance``, ``num_keys`` or ``corpus`` (too
            small), before any tokenization.
    """
    if family not in ALL_FAMILIES:
        raise ValueError(f"family={family!r} is not one of {ALL_FAMILIES}")
    if isinstance(context_len, bool) or int(context_len) != context_len or context_len < 128:
        raise ValueError(f"context_len must be an integer >= 128 tokens; got {context_len!r}")
    if not 0.0 <= float(edit_depth) <= 1.0:
        raise ValueError(f"edit_depth must be a fraction in [0, 1]; got {edit_depth!r}")
    derived = family in DERIVED_FAMILIES
    rebound = family in REBOUND_FAMILIES
    downstream = (family == "superseded_tool_output" or derived or rebound
                  or (family == "multi_key" and not ask_edited))
    if downstream and not (0.0 < float(distance) and float(edit_depth) + float(distance) <= 1.0):
        raise ValueError(
            f"distance must be > 0 with edit_depth + distance <= 1 for an answer-bearing block downstream of the "
            f"edit; got edit_depth={edit_depth!r}, distance={distance!r}"
        )
    if family == "multi_key" and (isinstance(num_keys, bool) or int(num_keys) != num_keys or num_keys < 2):
        raise ValueError(f"num_keys must be an integer >= 2 for multi_key; got {num_keys!r}")
    if len(corpus) == 0:
        raise ValueError("corpus is empty")
    rng = np.random.default_rng(seed)
    k = (int(num_keys) if family == "multi_key" else 2 if family == "derived_record" else 3 if rebound else 1)
    keys = [f"{s}-api" for s in rng.choice(SERVICES, size=k, replace=False)]
    edited_key = keys[0]
    # The derived families draw one more value: the inventory's third entry (neither old nor new). A rebound case
    # draws the two referents' values: the old referent's is the stale answer, the new referent's the gold one.
    values = _draw_values(tokenizer, rng, 3 if derived else 2 if rebound else k + 1, templates, edited_key)
    old, new = values[0], values[1]
    others = tuple(values[2:]) if derived else ()
    key_values = ({edited_key: old} if derived else {keys[1]: old, keys[2]: new} if rebound
                  else dict(zip(keys, [old, *values[2:]])))
    asked = keys[1] if family == "derived_record" or (family == "multi_key" and not ask_edited) else edited_key

    # Record blocks and their depths (fractions of the filler tokens); the edited block first.
    bearing_block = None
    if family in ("superseded_tool_output", "agent_note"):
        old_block = templates.tool_output.format(key=edited_key, value=old, call=TOOL_CALLS[0])
        new_block = templates.tool_output.format(
            key=edited_key, value=new, call=TOOL_CALLS[1] if family == "superseded_tool_output" else TOOL_CALLS[0])
    elif rebound:
        # The edit re-points the derived service (the asked key) from keys[1] to keys[2]; the records it points to
        # follow it, in a seeded order, at the answer-bearing depth.
        old_block = templates.derived.format(derived=edited_key, key=keys[1])
        new_block = templates.derived.format(derived=edited_key, key=keys[2])
    else:
        old_block = templates.fact.format(key=edited_key, value=old)
        new_block = templates.fact.format(key=edited_key, value=new)
    records = [(float(edit_depth), old_block)]
    if family == "superseded_tool_output":
        records.append((float(edit_depth) + float(distance), new_block))
    elif rebound:
        pointed = [(keys[1], old), (keys[2], new)]
        pointed = [pointed[int(j)] for j in rng.permutation(2)]
        records += [(float(edit_depth) + float(distance), templates.fact.format(key=key, value=v))
                    for key, v in pointed]
    elif derived:
        listed = [old, new, *others]
        listed = [listed[int(j)] for j in rng.permutation(len(listed))]
        # A wording may name the candidates in the derived block itself (field ``{values}``, the inventory's list).
        bearing_block = (templates.derived.format(derived=asked, key=edited_key, values=", ".join(listed))
                         if family == "derived_record" else
                         templates.note.format(key=edited_key, values=", ".join(listed)))
        records.append((float(edit_depth) + float(distance), bearing_block))
        if inventory:
            records.append((float(edit_depth) / 2, templates.inventory.format(values=", ".join(listed))))
    elif family == "multi_key":
        others_kv = [(key, key_values[key]) for key in keys[1:]]
        depths = []
        for j in range(len(others_kv)):
            if j == 0 and not ask_edited:
                depths.append(float(edit_depth) + float(distance))
            else:
                depths.append(float(np.round(rng.uniform(0.0, 1.0), 3)))
        records += [(d, templates.fact.format(key=key, value=v)) for d, (key, v) in zip(depths, others_kv)]
    if family == "agent_note":
        question = templates.note_question.format(key=asked)
        answer_prefix = templates.note_answer_prefix.format(key=asked)
    else:
        question = templates.question.format(key=asked)
        answer_prefix = templates.answer_prefix.format(key=asked)
    overhead = sum(len(tokenizer(b, add_special_tokens=False)["input_ids"]) + 1 for _, b in records)
    overhead += len(tokenizer(templates.instruction, add_special_tokens=False)["input_ids"]) + 40
    banned = [*keys, *values]
    filler, lengths, total = _filler(tokenizer, corpus, rng, int(context_len), overhead, banned)
    bounds = np.concatenate(([0], np.cumsum(lengths))) / max(1, total)
    slots = [int(np.argmin(np.abs(bounds - d))) for d, _ in records]
    # A passage follows the edited block, so its span is one whole passage segment (block and blank line).
    slots[0] = min(slots[0], len(filler) - 1)
    # Records at the same boundary keep their depth order (ties: their order in ``records``, the edited block first).
    order = sorted(range(len(records)), key=lambda i: (slots[i], records[i][0], i))
    blocks = list(filler)
    for i in reversed(order):
        blocks.insert(slots[i], records[i][1])
    position = {i: slots[i] + order.index(i) for i in range(len(records))}  # block index after insertion
    documents, spans = join_blocks(blocks)

    text, query_text, doc_start, containers = render_chat(
        tokenizer, documents, question, instruction=templates.instruction
    )
    query_text = query_text + answer_prefix
    cuts = chat_cuts(text, doc_start, documents)
    a, b = spans[position[0]]
    start, end = doc_start + a, doc_start + b
    control = None
    if family == "superseded_tool_output":
        edit = build_edit(tokenizer, text, query_text, (start, end), question=question, containers=containers,
                          cuts=cuts)
        inserted = ""
    else:
        old_text = text[start:end]
        inserted = old_text.replace(old_block, new_block)
        before, after = _pieces(text, cuts, 0, start), _pieces(text, cuts, end, len(text))
        edit = replacement_edit(tokenizer, before, old_text, inserted, after, query_text, question=question,
                                containers=containers)
        control = placement_control(tokenizer, before, old_text, inserted, after, query_text, question=question,
                                    containers=containers)
    m = len(tokenize_segments(tokenizer, [inserted])[0][0]) if inserted else 0

    # Token spans of the values and keys. A derived family names the gold and old values in its inventory too: the
    # answer's span is then the one in the inserted block, the old value's the one in the deleted span.
    gold = new if asked == edited_key or derived else key_values[asked]
    edited_text = edit.edited_text
    p, d = edit.prefix_len, edit.deleted_len
    gold_spans = _find_spans(edited_text, edit.edited_offsets, " " + gold)
    old_spans = _find_spans(edit.original_text, edit.original_offsets, " " + old)
    key_spans = _find_spans(edited_text, edit.edited_offsets, " " + asked)
    if derived:
        gold_spans = [sp for sp in gold_spans if p - m <= sp[0] and sp[1] <= p]
        old_spans = [sp for sp in old_spans if p <= sp[0] and sp[1] <= p + d]
    if len(gold_spans) != 1 or len(old_spans) != 1:
        raise ValueError(f"gold {gold!r} or old {old!r} value is not exactly one whole token span (seed={seed})")
    answer_in = "suffix" if gold_spans[0][0] >= p else "inserted"
    bearing = gold_spans[0]
    if derived:
        at = edited_text.find(bearing_block)
        bearing = char_token_span(edit.edited_offsets, at, at + len(bearing_block))
        answer_in = "suffix"
    if rebound:
        at = edited_text.find(templates.fact.format(key=keys[2], value=new))
        bearing = char_token_span(edit.edited_offsets, at, at + len(templates.fact.format(key=keys[2], value=new)))
    if answer_in == "inserted" and asked == edited_key:
        distance = 0.0
    return StaleCase(
        case_id=case_id or f"stale-{family}-{int(context_len)}-s{seed}",
        family=family,
        key=asked,
        edited_key=edited_key,
        gold=gold,
        old=old,
        new=new,
        stale_value=old if asked == edited_key or derived else None,
        values=key_values,
        inserted_len=m,
        context_len=int(context_len),
        edit_depth=float(edit_depth),
        distance=float(distance) if downstream else 0.0,
        answer_in=answer_in,
        answer_token_span=gold_spans[0],
        old_token_span=old_spans[0],
        key_token_spans=tuple(key_spans),
        gold_token=_first_token(tokenizer, " " + gold),
        old_token=_first_token(tokenizer, " " + old),
        seed=int(seed),
        edit=edit,
        others=others,
        bearing_token_span=bearing,
        control_edit=control,
    )


def placement_control(tokenizer, before: Sequence[str], old: str, inserted: str, after: Sequence[str],
                      query_text: str, *, question: str | None = None,
                      containers: tuple[tuple[int, int, str], ...] = ()) -> EditedContext:
    """The Erratum placement control of a replacement (issue 40): the same inserted block, placed right before the
    question instead of at the edit's depth.

    Erratum keeps the context before the edit and appends a note carrying the inserted text right before the
    question; a repair carries it at the edit's depth. The control puts the repairs at Erratum's recency: a deletion
    of ``old`` from ``before ⊕ old ⊕ after ⊕ inserted`` (:func:`sur_lab.edits.segment_edit`, each segment tokenized on
    its own), so Re-prefill of it prefills ``before ⊕ after ⊕ inserted`` and its Shift is what an agent holds after
    appending the inserted block to the context before the edit (its rows computed with the old value visible, as
    Erratum's note rows are) and deleting the old block. Its edited ids are a permutation of the replacement's
    (``tok(before) ⊕ tok(inserted) ⊕ tok(after)``): the same token multiset (tested).

    Args:
        tokenizer: the model's tokenizer.
        before, old, inserted, after, query_text, question: as :func:`sur_lab.edits.replacement_edit` (``inserted``
            is its ``new``).
        containers: ``(start, end, kind)`` spans of ``before + old + after``; a container that ends at the end of
            that text (the user message) is extended over the appended block.

    Returns:
        The deletion edit (``inserted_len`` 0).

    Raises:
        ValueError: naming ``inserted`` when it is empty; otherwise as :func:`sur_lab.edits.segment_edit`.
    """
    if not isinstance(inserted, str) or not inserted:
        raise ValueError("inserted must be a non-empty str (the placement control moves an inserted block)")
    before, after = ([x] if isinstance(x, str) else list(x) for x in (before, after))
    length = sum(map(len, before)) + len(old) + sum(map(len, after))
    grown = tuple((a, b + len(inserted) if b == length else b, kind) for a, b, kind in containers)
    return segment_edit(tokenizer, before, old, [*after, inserted], query_text, question=question, containers=grown)


def _pieces(text: str, cuts: Sequence[int], lo: int, hi: int) -> list[str]:
    """``text[lo:hi]`` cut at the segment boundaries strictly inside it (one piece per passage)."""
    inner = sorted({c for c in cuts if lo < c < hi})
    bounds = [lo, *inner, hi]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _find_spans(text: str, offsets, piece: str) -> list[tuple[int, int]]:
    """Token spans of every whole-word occurrence of ``piece`` in ``text`` (``None`` entries, a piece that is not a
    whole token span, raise)."""
    out = []
    for m in re.finditer(rf"{re.escape(piece)}(?![\w-])", text):
        span = _token_span(offsets, m.start(), m.end())
        if span is None:
            raise ValueError(f"{piece!r} at character {m.start()} is not a whole token span")
        out.append(span)
    return out


def build_stale_cases(
    tokenizer,
    *,
    context_lens: Sequence[int] = (512,),
    num_cases: int = 6,
    edit_depths: Sequence[float] = (0.2, 0.5),
    distances: Sequence[float] = (0.1, 0.4),
    num_keys: int = 4,
    families: Sequence[str] = FAMILIES,
    seed: int = 0,
    corpus: Sequence[Any] | None = None,
    templates: StaleTemplates = DEFAULT_TEMPLATES,
) -> list[StaleCase]:
    """A roster of stale-fact cases, balanced over families, edit depths, distances and context lengths.

    Case i has family ``families[i % F]``, asks the updated key when ``(i // F)`` is even (``multi_key``; the other
    families always ask it), edit depth ``edit_depths[(i // 2F) % D]``, distance ``distances[(i // 2FD) % R]`` and
    context length ``context_lens[(i // 2FDR) % C]``: a full factorial design every 2FDRC cases. A distance that would
    put the answer-bearing block past the end is reduced to ``1 - edit_depth``. Every random choice of case i comes from
    ``SeedSequence([seed, i])``, so a case does not depend on ``num_cases``.

    Args:
        tokenizer: the target model's tokenizer.
        context_lens: pre-query lengths, tokens (each >= 128).
        num_cases: number of cases (>= 1).
        edit_depths: edit depths in [0, 1].
        distances: answer-bearing distances in (0, 1].
        num_keys: keys per ``multi_key`` case (>= 2).
        families: task families (a subset of :data:`ALL_FAMILIES`).
        seed: roster seed.
        corpus: filler paragraphs (default: :func:`sur_lab.data.qa.load_corpus`).
        templates: the prompt wording.

    Raises:
        ValueError: naming ``num_cases``, ``context_lens``, ``edit_depths``, ``distances`` or ``families`` when empty
            or out of range (before any work).
    """
    if isinstance(num_cases, bool) or int(num_cases) != num_cases or num_cases < 1:
        raise ValueError(f"num_cases must be an integer >= 1; got {num_cases!r}")
    if not context_lens or any(int(c) != c or c < 128 for c in context_lens):
        raise ValueError(f"context_lens must be non-empty integers >= 128; got {context_lens!r}")
    if not edit_depths or any(not 0.0 <= float(x) < 1.0 for x in edit_depths):
        raise ValueError(f"edit_depths must be non-empty fractions in [0, 1); got {edit_depths!r}")
    if not distances or any(not 0.0 < float(x) <= 1.0 for x in distances):
        raise ValueError(f"distances must be non-empty fractions in (0, 1]; got {distances!r}")
    if not families or any(f not in ALL_FAMILIES for f in families):
        raise ValueError(f"families must be a non-empty subset of {ALL_FAMILIES}; got {families!r}")
    if corpus is None:
        from sur_lab.data.qa import load_corpus

        corpus = load_corpus()
    F, D, R = len(families), len(edit_depths), len(distances)
    cases = []
    for i in range(int(num_cases)):
        family = families[i % F]
        ask_edited = (i // F) % 2 == 0
        depth = float(edit_depths[(i // (2 * F)) % D])
        distance = min(float(distances[(i // (2 * F * D)) % R]), 1.0 - depth)
        ctx = int(context_lens[(i // (2 * F * D * R)) % len(context_lens)])
        case_seed = int(np.random.SeedSequence([int(seed), i]).generate_state(1)[0])
        cases.append(build_stale_case(
            tokenizer, corpus, family=family, context_len=ctx, edit_depth=depth, distance=distance,
            num_keys=num_keys, ask_edited=ask_edited, seed=case_seed, case_id=f"stale-{ctx}-{i:03d}",
            templates=templates,
        ))
    return cases


def pre_edit_context_ids(case: StaleCase) -> torch.Tensor:
    """``[N - m]`` int64: the context an agent held before the edit (the inserted tokens removed); for a deletion,
    ``edit.original_ids``. The Erratum operator extends a prefill of it (:func:`sur_lab.executors.pre_edit_ids`)."""
    from sur_lab.executors.erratum import pre_edit_ids

    return pre_edit_ids(case.edit, case.inserted_len)


#: Preset sizes that :func:`stale_cases` reads (the others are sweep options: budgets, decoding limit, allocators).
CASE_SIZES = ("context_lens", "num_cases", "edit_depths", "distances", "num_keys")


def stale_cases(tokenizer, preset: str = "default", *, seed: int = 0, corpus: Sequence[Any] | None = None,
                families: Sequence[str] = FAMILIES, **overrides: Any) -> list[StaleCase]:
    """The :class:`StaleCase` roster of ``preset`` (:data:`PRESETS`; sizes overridden by any non-``None`` keyword of
    :data:`CASE_SIZES`), built by :func:`build_stale_cases`. :meth:`STUDY.cases` gives them as sweep cases.

    Raises:
        ValueError: naming ``preset`` when unknown or an override that is not a case size; as
            :func:`build_stale_cases`.
    """
    from sur_lab.studies.presets import resolve_preset

    bad = [k for k in overrides if k not in CASE_SIZES]
    if bad:
        raise ValueError(f"{bad[0]} is not a case size of this study; case sizes: {', '.join(CASE_SIZES)}")
    sizes = resolve_preset(PRESETS, preset, **overrides)
    return build_stale_cases(tokenizer, seed=seed, corpus=corpus, families=tuple(families),
                             **{k: sizes[k] for k in CASE_SIZES})


# ---------------------------------------------------------------------------------------------------------------------
# The study (notebook 09 and ``sur-lab sweep stale-facts`` call the same methods): declarations on the Study base

#: The study's name in the registry (``sur-lab sweep stale-facts``), its notebook, and its sweep folders' prefix.
NAME = "stale-facts"
NOTEBOOK = "09_stale_facts"
FOLDER = "09_stale_facts"
#: Parameters that are not preset sizes, at the notebook's defaults (the literals of its ``parameters`` cell):
#: the task families, the reference operators, and the Erratum note's template
#: (:data:`sur_lab.executors.ERRATUM_TEMPLATES`).
FIXED = {"families": list(FAMILIES), "references": list(STUDY_REFERENCES), "erratum_template": "default"}
#: The arms of the paired comparisons (issue 26): SUR, its variant and the 2026 baselines.
COMPARED = ("SUR", "SUR-IDF", "Edit-local window", "Edit-local + SUR", "Erratum")
#: The budget (%) of the primary comparison.
PRIMARY_BUDGET = 5.0
#: The declared comparisons of notebook 09 (issue 36; :mod:`sur_lab.analysis.decisions`), fixed before any run: one
#: primary comparison and two small families (the all-pairs table they replace held 38 comparisons per endpoint).
#: Cases are the paired units (independent constructions).
PRIMARY = Family("primary", "binary", f"SUR at {PRIMARY_BUDGET:g} % minus Shift on EM", primary=True)
#: The power statement's basis (issue 40; :data:`POWER`): a planning value, not a measurement. No paper reports this
#: comparison; SUR and Shift are taken to disagree on half the cases (two arms each right about half the time,
#: independently), the rate that a measured default run replaces.
PRIMARY_POWER = PowerBasis(0.5, "a planning value (no published rate): SUR and Shift disagree on half the cases")
EM_FAMILY = Family("EM against SUR", "binary",
                   "SUR-IDF, the edit-local window and edit-local + SUR minus SUR at the same budget, and Erratum "
                   "minus SUR at each budget, on EM")
STALE_FAMILY = Family("stale-answer rate against Shift", "binary",
                      "each compared arm (SUR, SUR-IDF, the edit-local window, edit-local + SUR at each budget; "
                      "Erratum) minus Shift on the stale-answer rate, over the cases that ask the edited key (lower is "
                      "better)",
                      higher_is_better=False)
#: The Erratum placement control (issue 40): on each replacement case, Shift and Re-prefill also run on
#: :attr:`StaleCase.control_edit` (the inserted block right before the question, where Erratum's note sits); their
#: records carry these method labels and the case's own ``case_id``, so they pair with Erratum case by case.
LATE = " (late)"
PLACEMENT_METHODS = ("Shift", "Re-prefill")
PLACEMENT_FAMILY = Family("Erratum at equal recency", "binary",
                          "Re-prefill and Shift with the inserted block right before the question (the placement "
                          "control) minus Erratum, on EM, over the replacement cases")
#: The design requirement of issue 40 checked per family (:func:`stale_rates`): Shift answers the old value in at
#: least this fraction of the family's stale-eligible cases, by the exact (Clopper-Pearson) lower bound.
STALE_REACH = 0.05
#: Arms whose old-value pull (``old_margin``) is compared with Re-prefill's per family (:func:`old_margin_differences`;
#: descriptive intervals).
PULL_ARMS = ("Shift", "Dirty", "Erratum", f"SUR {PRIMARY_BUDGET:g}%", "Shift" + LATE)
#: The gold-margin differences by answer location (:func:`margin_differences`) are descriptive: intervals only, no
#: verdict (they are not a declared family).
MARGIN_ARMS = ("Edit-local window", "Edit-local + SUR")


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
        from sur_lab.executors import erratum_templates

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
        from sur_lab.sweeps import run_sweep

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
    from sur_lab.fingerprint import digest

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


# ---------------------------------------------------------------------------------------------------------------------
# Report: stale-answer rate, EM, margin recovery, paired differences, the generated conclusion


def add_stale_endpoints(records: pd.DataFrame) -> pd.DataFrame:
    """Records with the study's endpoints added (a new DataFrame): ``answer_class`` (:func:`classify_answer` of each
    record's answer with its case's values, read from the meta columns ``gold_value``, ``stale_value`` and
    ``distractor_values``), ``stale`` (float: 1.0 when the answer gives the superseded value; NaN for a query about
    an untouched key, which has no stale value) and ``margin_recovery``
    (:func:`sur_lab.analysis.endpoints.add_margin_recovery`: NaN where undefined).

    Raises:
        ValueError: naming ``records`` when a meta column or a case's Shift or Re-prefill record is missing.
    """
    from sur_lab.analysis.endpoints import add_margin_recovery

    missing = [c for c in ("answer", "gold_value", "stale_value", "distractor_values", "gold_margin")
               if c not in records.columns]
    if missing:
        raise ValueError(f"records lack the columns {missing} (stale-fact sweep records carry them)")
    classes = [
        classify_answer(a, g, s or None, tuple(v for v in str(d).split(",") if v))
        for a, g, s, d in zip(records["answer"], records["gold_value"], records["stale_value"].fillna(""),
                              records["distractor_values"].fillna(""))
    ]
    asks_old = records["stale_value"].fillna("").astype(str) != ""
    stale = np.where(asks_old, [float(c == "stale") for c in classes], np.nan)
    return add_margin_recovery(records.assign(answer_class=classes, stale=stale))


def _arm(records: pd.DataFrame) -> pd.Series:
    """A label per record: the method, with its budget for budgeted methods (``"SUR 5%"``;
    :func:`sur_lab.analysis.conclusions.arm_labels`)."""
    from sur_lab.analysis.conclusions import arm_labels

    return arm_labels(records)


def summary_table(records: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, budget): EM %, stale-answer rate % (over the cases asking the edited key), agreement
    with Re-prefill %, the margin recovery as a ratio of sums (``margin_recovery``, NaN when undefined, with the reason
    in ``margin_recovery_note``: :func:`sur_lab.analysis.endpoints.pooled_margin_recovery`) and, secondary, the
    median of the defined per-case ratios with their count, mean first-token TV to Re-prefill, mean forward tokens
    of the repair (``allowance + note_tokens``: suffix rows recomputed, or the Erratum note) and median refresh time
    (ms); references (budget NaN) first, then the allocators by budget.

    Args:
        records: :func:`add_stale_endpoints` records.
    """
    df = records.assign(_cost=records["allowance"] + records["note_tokens"], _em=records["em"].astype(float),
                        _agree=records["agree_reprefill"].astype(float))
    g = df.groupby(["method", "budget_pct"], dropna=False, sort=False)
    out = g.agg(n=("case_id", "size"), em_pct=("_em", "mean"), stale_pct=("stale", "mean"),
                n_stale_cases=("stale", "count"), agree_pct=("_agree", "mean"),
                margin_recovery_median=("margin_recovery", "median"), n_margin_defined=("margin_recovery", "count"),
                gold_margin_median=("gold_margin", "median"), tv_reprefill=("tv_reprefill", "mean"),
                forward_tokens=("_cost", "mean"), refresh_ms=("refresh_ms", "median")).reset_index()
    for col in ("em_pct", "stale_pct", "agree_pct"):
        out[col] = 100 * out[col]
    from sur_lab.analysis.endpoints import margin_recovery_table

    pooled = margin_recovery_table(records).reset_index()
    pooled = pooled.set_index([pooled["method"], pooled["budget_pct"].map(lambda b: "-" if pd.isna(b) else float(b))])
    keys = list(zip(out["method"], out["budget_pct"].map(lambda b: "-" if pd.isna(b) else float(b))))
    at = out.columns.get_loc("margin_recovery_median")
    out.insert(at, "margin_recovery_note", [pooled.loc[k, "note"] for k in keys])
    out.insert(at, "margin_recovery", [float(pooled.loc[k, "ratio"]) for k in keys])
    refs = [m for m in (*STUDY_REFERENCES,) if m in set(out["method"])]
    order = {m: i for i, m in enumerate([*refs, *STUDY_ALLOCATORS])}
    out["_r"] = out["budget_pct"].notna().astype(int)
    out["_o"] = out["method"].map(order).fillna(len(order))
    return out.sort_values(["_r", "budget_pct", "_o"], na_position="first").drop(columns=["_r", "_o"]) \
        .reset_index(drop=True)


def family_pairs(records: pd.DataFrame, family: Family) -> list[tuple[str, str]]:
    """The comparisons ``(a, b)`` (arm labels: ``"SUR 5%"``, ``"Erratum"``, ``"Shift (late)"``) that ``family``
    (:data:`PRIMARY`, :data:`EM_FAMILY`, :data:`STALE_FAMILY` or :data:`PLACEMENT_FAMILY`) holds among the arms of
    ``records``.

    Raises:
        ValueError: naming ``family`` when it is not one of the three.
    """
    if family not in (PRIMARY, EM_FAMILY, STALE_FAMILY, PLACEMENT_FAMILY):
        raise ValueError(f"family={family.name!r}: family_pairs knows PRIMARY, EM_FAMILY, STALE_FAMILY and "
                         "PLACEMENT_FAMILY")
    arms = set(_arm(records))
    budgets = sorted(records.loc[records["budget_pct"].notna(), "budget_pct"].unique())
    budgeted = [m for m in COMPARED if m != "Erratum"]
    if family == PRIMARY:
        candidates = [(f"SUR {PRIMARY_BUDGET:g}%", "Shift")]
    elif family == PLACEMENT_FAMILY:
        candidates = [(m + LATE, "Erratum") for m in ("Re-prefill", "Shift")]
    elif family == EM_FAMILY:
        candidates = [(f"{m} {b:g}%", f"SUR {b:g}%") for b in budgets for m in budgeted if m != "SUR"]
        candidates += [("Erratum", f"SUR {b:g}%") for b in budgets]
    else:
        candidates = [(f"{m} {b:g}%", "Shift") for b in budgets for m in budgeted] + [("Erratum", "Shift")]
    return [p for p in candidates if p[0] in arms and p[1] in arms]


def paired_differences(records: pd.DataFrame, *, n_boot: int = 10_000, seed: int = 20260928,
                       decide: bool = True) -> pd.DataFrame:
    """The study's declared comparisons, decided (:func:`sur_lab.analysis.decisions.paired_family`): the primary
    (SUR at 5 % minus Shift on EM, tested alone), :data:`EM_FAMILY`, :data:`STALE_FAMILY` and, where the placement
    control ran, :data:`PLACEMENT_FAMILY` (Holm within each; its pairs cover the replacement cases).
    ``stale`` is compared on the cases that ask the edited key (the others have no stale value: NaN, left out); a
    lower stale rate is better, so a negative difference favours ``a``.

    Args:
        records: :func:`add_stale_endpoints` records.
        n_boot, seed: sign-flip resamples (unused by binary endpoints' exact tests) and generator seed.
        decide: ``False`` at a plumbing-check size (``decisions.decides(preset)``).

    Returns:
        :func:`~sur_lab.analysis.decisions.paired_family` rows of the three families with ``metric`` (``"em"`` or
        ``"stale"``) and ``budget_pct`` (of ``a``; NaN for Erratum), and the differences in points
        (:func:`sur_lab.analysis.decisions.in_units`: ``delta``, ``delta_low``, ``delta_high``, ``delta_mde``, ``unit``
        "pp").

    Raises:
        ValueError: naming ``records`` when a case lacks a compared arm's row.
    """
    from sur_lab.analysis.conclusions import paired_outcomes
    from sur_lab.analysis.decisions import COLUMNS, DIFF_COLUMNS, in_units, paired_family

    df = records.assign(arm=_arm(records), _em=records["em"].astype(float), _stale=records["stale"].astype(float))
    budget_of = dict(zip(df["arm"], df["budget_pct"]))
    parts = []
    for fam, metric in ((PRIMARY, "em"), (EM_FAMILY, "em"), (STALE_FAMILY, "stale"), (PLACEMENT_FAMILY, "em")):
        pairs = family_pairs(df, fam)
        if not pairs:
            continue
        outcomes, _ = paired_outcomes(df, pairs, f"_{metric}")
        out = paired_family(outcomes, family=fam, n_boot=n_boot, seed=seed, decide=decide)
        parts.append(out.assign(metric=metric, budget_pct=[budget_of[a] for a in out["a"]]))
    if not parts:
        return pd.DataFrame(columns=[*COLUMNS, "metric", "budget_pct", *DIFF_COLUMNS])
    return in_units(pd.concat(parts, ignore_index=True))


def margin_differences(records: pd.DataFrame, *, arms: Sequence[str] = MARGIN_ARMS, by: str = "answer_in",
                       n_boot: int = 10_000, seed: int = 20260928) -> pd.DataFrame:
    """The edit-local claim on the gold answer's first-token margin (``gold_margin``, logits): each of ``arms``
    minus SUR at each budget, case-paired, within each value of ``by`` (where the answer-bearing text sits:
    ``"inserted"`` or ``"suffix"``). Descriptive: percentile bootstrap intervals
    (:func:`sur_lab.analysis.decisions.paired_family`) without a verdict, as the margin is not a declared family of
    the study.

    The margin is continuous where EM saturates, so it shows whether the window moves the answer toward Re-prefill's
    more than SUR does, and whether that fades when the answer sits downstream ("Contiguity, Not Importance").

    Args:
        records: :func:`add_stale_endpoints` records (``gold_margin`` defined).
        arms: budgeted methods compared with SUR.
        by: the record column whose values split the cases.
        n_boot, seed: bootstrap replicates (>= 100) and generator seed.

    Returns:
        One row per (``by`` value, budget_pct, a): ``b`` (SUR at that budget), ``delta``, ``delta_low``, ``delta_high``
        (a minus b, 95 %; a positive difference favours ``a``), ``unit`` ("logits"), ``n`` (cases): the schema of
        :func:`sur_lab.analysis.decisions.in_units`.

    Raises:
        ValueError: naming ``by`` when it is not a record column.
    """
    from sur_lab.analysis.conclusions import paired_outcomes
    from sur_lab.analysis.decisions import in_units, paired_family

    if by not in records.columns:
        raise ValueError(f"by={by!r} is not a record column")
    df = records.assign(arm=_arm(records), _m=records["gold_margin"].astype(float))
    budget_of = dict(zip(df["arm"], df["budget_pct"]))
    budgets = sorted(df.loc[df["method"] == "SUR", "budget_pct"].dropna().unique())
    cols = [by, "budget_pct", "a", "b", "delta", "delta_low", "delta_high", "unit", "n"]
    parts = []
    for value, sub in df.groupby(by, sort=True):
        pairs = [(f"{m} {b:g}%", f"SUR {b:g}%") for b in budgets for m in arms]
        outcomes, _ = paired_outcomes(sub, [p for p in pairs if p[0] in set(sub["arm"])], "_m")
        if not outcomes:
            continue
        res = in_units(paired_family(outcomes, kind="continuous", n_boot=n_boot, seed=seed, decide=False),
                       unit="logits")
        parts.append(res.assign(**{by: value, "budget_pct": [budget_of[a] for a in res["a"]]})[cols])
    return pd.concat(parts, ignore_index=True)[cols] if parts else pd.DataFrame(columns=cols)


def stale_rates(records: pd.DataFrame, *, arms: Sequence[str] = ("Shift", "Re-prefill", "Dirty", "Erratum",
                                                                "Shift" + LATE),
                decide: bool = True) -> pd.DataFrame:
    """Each arm's stale-answer rate per family with its exact interval, and whether the family shows stale answers:
    the design requirement of issue 40 (Shift must answer the old value where the answer-bearing states are stale).

    Args:
        records: :func:`add_stale_endpoints` records (``stale`` NaN where the query has no stale value).
        arms: arm labels (:func:`_arm`) to tabulate; absent ones are skipped.
        decide: ``False`` at a plumbing-check size (the claim column then reads "not decided").

    Returns:
        One row per (family, arm): ``k`` stale answers of ``n`` stale-eligible cases, ``rate``, ``ci_low``,
        ``ci_high`` (Clopper-Pearson 95 %, :func:`sur_lab.analysis.decisions.proportion_interval`) and ``claim``:
        :func:`sur_lab.analysis.decisions.bound_claim` of "at least :data:`STALE_REACH`" (its verdict word).
    """
    from sur_lab.analysis.decisions import bound_claim, proportion_interval

    df = records.assign(arm=_arm(records))
    rows = []
    for family, sub in df.groupby("family", sort=False):
        for arm in arms:
            st = sub.loc[sub["arm"] == arm, "stale"].dropna()
            if st.empty:
                continue
            k, n = int(st.sum()), int(st.size)
            rate, low, high = proportion_interval(k, n)
            rows.append({"family": family, "arm": arm, "k": k, "n": n, "rate": rate, "ci_low": low, "ci_high": high,
                         "claim": bound_claim(k, n, at_least=STALE_REACH, decide=decide)})
    cols = ["family", "arm", "k", "n", "rate", "ci_low", "ci_high", "claim"]
    return pd.DataFrame(rows, columns=cols)


def stale_rate_lines(rates: pd.DataFrame, *, arm: str = "Shift") -> list[str]:
    """:func:`stale_rates` of ``arm`` in words, one line per family: ``"derived_record: Shift answers the old value
    in 0 of 16 stale-eligible cases (0 %, 95 % CI 0 % to 21 %): at least 5 % not shown"``."""
    out = []
    for r in rates[rates["arm"] == arm].itertuples():
        out.append(f"{r.family}: {arm} answers the old value in {r.k} of {r.n} stale-eligible case"
                   f"{'s' if r.n != 1 else ''} ({100 * r.rate:.0f} %, 95 % CI {100 * r.ci_low:.0f} % to "
                   f"{100 * r.ci_high:.0f} %): at least {100 * STALE_REACH:g} % {r.claim}")
    return out


def old_margin_differences(records: pd.DataFrame, *, arms: Sequence[str] = PULL_ARMS, n_boot: int = 10_000,
                           seed: int = 20260928) -> pd.DataFrame:
    """The old value's pull (``old_margin``: the old value's first-token logit minus the gold one's, logits) of each
    of ``arms`` minus Re-prefill's, case-paired within each family, over the stale-eligible cases. Descriptive:
    percentile bootstrap intervals (:func:`sur_lab.analysis.decisions.paired_family`, continuous) without a verdict.

    A positive difference means the arm's states pull toward the superseded value more than a clean prefill does,
    even where its greedy answer is right (the stale rate can be 0 while the pull is not). A placement-control arm
    (``"Shift (late)"``) is compared with its own layout's Re-prefill (``"Re-prefill (late)"``).

    Args:
        records: :func:`add_stale_endpoints` records with ``old_margin``.
        arms: arm labels; absent ones are skipped.
        n_boot, seed: bootstrap replicates and generator seed.

    Returns:
        One row per (family, a): ``b``, ``mean_a``, ``mean_b`` (mean pulls, logits), ``delta``, ``delta_low``,
        ``delta_high`` (a minus b, 95 %), ``unit`` ("logits"), ``n`` (cases): the schema of
        :func:`sur_lab.analysis.decisions.in_units`.

    Raises:
        ValueError: naming ``records`` when it has no ``old_margin`` column.
    """
    from sur_lab.analysis.conclusions import paired_outcomes
    from sur_lab.analysis.decisions import in_units, paired_family

    if "old_margin" not in records.columns:
        raise ValueError("records lack the column 'old_margin' (sweep records carry it since issue 40)")
    cols = ["family", "a", "b", "mean_a", "mean_b", "delta", "delta_low", "delta_high", "unit", "n"]
    eligible = records["stale_value"].fillna("").astype(str) != ""
    df = records[eligible].assign(arm=lambda d: _arm(d), _m=lambda d: d["old_margin"].astype(float))
    parts = []
    for family, sub in df.groupby("family", sort=False):
        present = set(sub["arm"])
        pairs = [(a, "Re-prefill" + LATE if a.endswith(LATE) else "Re-prefill") for a in arms]
        outcomes, _ = paired_outcomes(sub, [p for p in pairs if p[0] in present and p[1] in present], "_m")
        if not outcomes:
            continue
        res = in_units(paired_family(outcomes, kind="continuous", n_boot=n_boot, seed=seed, decide=False),
                       unit="logits")
        means = {pair: (float(np.nanmean(x)), float(np.nanmean(y))) for pair, (x, y) in outcomes.items()}
        parts.append(res.assign(family=family,
                                mean_a=[means[(a, b)][0] for a, b in zip(res["a"], res["b"])],
                                mean_b=[means[(a, b)][1] for a, b in zip(res["a"], res["b"])])[cols])
    return pd.concat(parts, ignore_index=True)[cols] if parts else pd.DataFrame(columns=cols)


def stratified_table(records: pd.DataFrame, by: str = "family", value: str = "em") -> pd.DataFrame:
    """Mean ``value`` (x100 for 0/1 columns) per arm (rows) and ``by`` stratum (columns): e.g. EM by family, or the
    stale rate by ``answer_in`` / ``distance`` (where the edit-local claim is said to fade). ``"margin_recovery"`` is
    pooled per cell as a ratio of sums (:func:`sur_lab.analysis.endpoints.margin_recovery_table`; NaN when
    undefined), not a mean of per-case ratios."""
    if value == "margin_recovery":
        from sur_lab.analysis.endpoints import margin_recovery_table

        t = margin_recovery_table(records.assign(arm=_arm(records)), by=("arm", by)).reset_index()
        return t.set_index(["arm", by])["ratio"].unstack(by).reindex(list(dict.fromkeys(t["arm"])))
    df = records.assign(arm=_arm(records), _v=records[value].astype(float))
    table = df.pivot_table(index="arm", columns=by, values="_v", aggfunc="mean", sort=False)
    return 100 * table if value in ("em", "stale", "agree_reprefill") else table


def conclusion(summary: pd.DataFrame, diffs: pd.DataFrame, *, model: str, n_cases: int,
               records: pd.DataFrame | None = None, margins: pd.DataFrame | None = None, by: str = "answer_in",
               decide: bool = True, rates: pd.DataFrame | None = None,
               pulls: pd.DataFrame | None = None) -> list[str]:
    """The generated conclusion, from this run's tables: the references' EM and stale rates, at each budget the
    compared arm with the highest EM (ties are ties, the selection named: :func:`sur_lab.analysis.decisions.best_of`
    on ``records``), the primary comparison and each declared family's comparisons in words
    (:func:`paired_differences`), where SUR loses (a "beats" against it), and with ``margins`` the descriptive
    gold-margin intervals.

    Args:
        summary: :func:`summary_table` of the run.
        diffs: :func:`paired_differences` of the run.
        model: the model's name; n_cases: cases in the run.
        records: the run's :func:`add_stale_endpoints` records (for the best-arm lines; without them those lines are
            left out).
        margins: :func:`margin_differences` of the run (optional); by: its split column.
        decide: as :func:`paired_differences` (the best-arm lines' comparisons).
        rates: :func:`stale_rates` of the run (optional): Shift's stale rate per family with its exact interval
            and the :data:`STALE_REACH` claim.
        pulls: :func:`old_margin_differences` of the run (optional): the old value's pull against Re-prefill.
    """
    from sur_lab.analysis.decisions import BEATS, LOSES, best_of, family_lines

    lines = [f"This run: {model}; {n_cases} stale-fact cases."]
    s = summary.assign(arm=_arm(summary))
    ref = s[s["budget_pct"].isna()].set_index("method")

    def fmt(m: str) -> str:
        r = ref.loc[m]
        stale = "n/a (no stale-eligible case)" if pd.isna(r.stale_pct) else f"{r.stale_pct:.0f} %"
        return f"{m} EM {r.em_pct:.0f} % (stale {stale})"

    lines.append("References: " + "; ".join(fmt(m) for m in ref.index) + ".")
    if records is not None:
        df = records.assign(arm=_arm(records))
        for b in sorted(df.loc[df["budget_pct"].notna(), "budget_pct"].unique()):
            arms = [a for a in [*(f"{m} {b:g}%" for m in COMPARED if m != "Erratum"), "Erratum"] if a in set(df["arm"])]
            if not arms:
                continue
            wide = df[df["arm"].isin(arms)].pivot(index="case_id", columns="arm", values="em").astype(float)
            lines.append(f"At {b:g} %, EM: " + best_of({a: wide[a].to_numpy() for a in arms}, kind="binary",
                                                      what="compared arms", decide=decide) + ".")
    na = "no stale-eligible case"
    lines += family_lines(diffs, na=na)
    losses = []
    for _, r in diffs.iterrows():
        loser = r["b"] if r["verdict"] == BEATS else (r["a"] if r["verdict"] == LOSES else None)
        if loser is not None and str(loser).startswith(("SUR ", "SUR-IDF ")):
            losses.append(f"{loser} against {r['a'] if loser == r['b'] else r['b']} on {r['metric']}")
    lines.append("Where SUR loses (a separated verdict against it): "
                 + ("; ".join(losses) if losses else "nowhere in this run" if decide else
                    "not decided at this size (a plumbing check)") + ".")
    if rates is not None and len(rates):
        lines.append("Stale answers under Shift, per family (exact intervals): " + "; ".join(stale_rate_lines(rates))
                     + ".")
    if pulls is not None and len(pulls):
        for family, block in pulls.groupby("family", sort=False):
            lines.append(f"Old-value pull (old minus gold first-token logit, descriptive intervals), {family}: " + "; ".join(
                f"{r.a} minus {r.b} {r.delta:+.3g}" + (
                    f" (95 % CI {r.delta_low:+.3g} to {r.delta_high:+.3g}" if not pd.isna(r.delta_low)
                    else " (no interval") + f"; {r.n} case{'s' if r.n != 1 else ''})"
                for r in block.itertuples()) + ".")
    if margins is not None and len(margins):
        for value, block in margins.groupby(by, sort=True):
            lines.append(f"Gold margin (logits, descriptive intervals, not a declared family), answer in the {value} "
                         "text: " + "; ".join(
                             f"{r.a} minus {r.b} {r.delta:+.3g} (95 % CI {r.delta_low:+.3g} to "
                             f"{r.delta_high:+.3g}; {r.n} case{'s' if r.n != 1 else ''})"
                             if not pd.isna(r.delta_low) else
                             f"{r.a} minus {r.b} {r.delta:+.3g} (no interval; {r.n} case"
                             f"{'s' if r.n != 1 else ''})"
                             for r in block.itertuples()) + ".")
    return lines


def plot_summary(summary: pd.DataFrame):
    """Bars of EM, stale-answer rate (%) and margin recovery (a ratio of sums; no bar where undefined) per arm,
    references and each budget's allocators; returns the figure."""
    import matplotlib.pyplot as plt

    s = summary.assign(arm=_arm(summary))
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.32 * len(s) + 1.8), sharey=True)
    titles = ["EM (%)", "stale answers (%)", "margin recovery, ratio of sums (0 = Shift, 1 = Re-prefill)"]
    for ax, col, title in zip(axes, ["em_pct", "stale_pct", "margin_recovery"], titles):
        colors = ["0.5" if pd.isna(b) else "tab:blue" for b in s["budget_pct"]]
        ax.barh(s["arm"], s[col] if col == "margin_recovery" else s[col].fillna(0.0), color=colors)
        ax.set_title(title)
        ax.invert_yaxis() if ax is axes[0] else None
    fig.tight_layout()
    return fig
