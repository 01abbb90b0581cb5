"""A stale-fact case and its scoring: the prompt wording (:class:`StaleTemplates`), the keys and values a case draws
from (:data:`SERVICES`, :data:`TARGET_STEMS`), the case itself (:class:`StaleCase`, with its sweep case and its Erratum
placement control's) and the answer classes (:func:`classify_answer`, :func:`answer_class`, the sweep scorer
:func:`stale_fact_scorer`, :func:`is_stale_answer`). :mod:`~sur_lab.studies.stale_facts.construction` builds the cases.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sur_lab.edits import EditedContext
from sur_lab.sweeps import Case

__all__ = ["StaleTemplates", "DEFAULT_TEMPLATES", "SERVICES", "TARGET_STEMS", "TOOL_CALLS", "LENGTH_SLACK",
    "StaleCase", "classify_answer", "answer_class", "stale_fact_scorer", "is_stale_answer"]


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
        return Case(self.case_id, self.edit, (self.gold,), self.meta())

    def control_case(self):
        """The Erratum placement control (:attr:`control_edit`) as a sweep ``Case``: case id ``{case_id}-late``,
        the case's meta with ``layout = "late"`` (the inserted block right before the question); ``None`` for a
        deletion case (no inserted block)."""
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
