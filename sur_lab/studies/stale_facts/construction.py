"""The construction of stale-fact cases: one case (:func:`build_stale_case`: filler from shuffled corpus paragraphs,
record blocks at controlled depths, the edit, the token spans of keys and values, checked as whole spans), the
Erratum placement control of a replacement (:func:`placement_control`), a balanced roster (:func:`build_stale_cases`),
a preset's roster (:func:`stale_cases`) and the context an agent held before the edit
(:func:`pre_edit_context_ids`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from sur_lab.data.qa import load_corpus
from sur_lab.data.text import char_token_span, draw_filler, join_blocks
from sur_lab.edits import (
    EditedContext,
    build_edit,
    chat_cuts,
    render_chat,
    replacement_edit,
    segment_edit,
    tokenize_segments,
)
from sur_lab.executors.erratum import pre_edit_ids
from sur_lab.studies.presets import resolve_preset
from sur_lab.studies.stale_facts.cases import (
    DEFAULT_TEMPLATES,
    LENGTH_SLACK,
    SERVICES,
    TARGET_STEMS,
    TOOL_CALLS,
    StaleCase,
    StaleTemplates,
    _mentions,
)
from sur_lab.studies.stale_facts.design import ALL_FAMILIES, DERIVED_FAMILIES, FAMILIES, PRESETS, REBOUND_FAMILIES

__all__ = ["build_stale_case", "placement_control", "build_stale_cases", "pre_edit_context_ids", "CASE_SIZES",
    "stale_cases"]


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

    # A block too long for the remaining room, or one that names a case key or value (an ambiguous context), is
    # passed over.
    blocks, lengths, total = draw_filler(count, corpus, rng, context_len=context_len, overhead=overhead,
                                         ceiling=context_len * (1.0 + LENGTH_SLACK),
                                         skip=lambda block: any(_mentions(block, b) for b in banned))
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
    bad = [k for k in overrides if k not in CASE_SIZES]
    if bad:
        raise ValueError(f"{bad[0]} is not a case size of this study; case sizes: {', '.join(CASE_SIZES)}")
    sizes = resolve_preset(PRESETS, preset, **overrides)
    return build_stale_cases(tokenizer, seed=seed, corpus=corpus, families=tuple(families),
                             **{k: sizes[k] for k in CASE_SIZES})
