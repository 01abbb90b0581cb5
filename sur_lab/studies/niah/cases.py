"""Erasing-NIAH cases: two same-key needles in a haystack of real Wikipedia paragraphs; deleting one changes the
answer (section 4.2, appendix 7.5), and the strict answer parser that scores them.

The original 96 cases are not public; this module builds the construction. A case is a chat prompt whose documents are
shuffled 2WikiMultiHopQA corpus paragraphs (``Title: ...`` blocks separated by blank lines) holding two needles
``"One of the special magic numbers for KEY is: VALUE."`` with the same KEY and different 7-digit VALUEs, each its own
block. The question asks for all of KEY's numbers in order of appearance; the original answer lists both values, and
deleting one needle's block (with its blank-line separator) leaves exactly the documents without it, whose answer is
the other value alone. The prompt follows RULER's multi-value NIAH wording (instruction, needle and question); a short
assistant answer prefix (the key's name) is part of the query, as in RULER.

Scoring (appendix 7.5): :func:`parse_niah_answer` extracts every digit run after explicit response/channel boundaries
with marked thinking blocks removed; ordinary newlines do not truncate; nothing is de-duplicated or matched against the
gold list. Strict exact match (:func:`niah_exact_match`) requires the parsed list to equal the gold list in order and
multiplicity.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sur_lab.analysis.endpoints import canonical_answer_ids
from sur_lab.analysis.scoring import END_OF_TURN_TOKENS
from sur_lab.data.qa import load_corpus
from sur_lab.data.text import char_token_span, draw_filler, join_blocks
from sur_lab.edits import EditedContext, build_edit, chat_cuts, render_chat
from sur_lab.sweeps import Case

__all__ = ["NIAH_INSTRUCTION", "NEEDLE_TEMPLATE", "QUESTION_TEMPLATE", "ANSWER_PREFIX_TEMPLATE", "MIN_DEPTH_GAP",
    "RESPONSE_BOUNDARIES", "parse_niah_answer", "niah_exact_match", "niah_scorer", "NiahCase", "build_niah_case",
    "build_niah_cases"]

#: RULER's multi-value NIAH instruction, placed before the documents.
NIAH_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
#: One needle (RULER's wording).
NEEDLE_TEMPLATE = "One of the special magic numbers for {key} is: {value}."
#: The question (the relevance query of SUR and BM25).
QUESTION_TEMPLATE = (
    "What are all the special magic numbers for {key} mentioned in the provided text? "
    "Answer with the numbers only, separated by commas."
)
#: Assistant answer prefix appended to the query after the chat template's generation prompt (RULER's answer prefix).
ANSWER_PREFIX_TEMPLATE = "The special magic numbers for {key} mentioned in the provided text are:"
#: Needle depths are drawn at least this far apart (fraction of the filler tokens).
MIN_DEPTH_GAP = 0.05


_ADJECTIVES = (
    "amber", "bold", "brave", "calm", "clever", "crisp", "dusty", "eager", "faint", "fancy", "gentle", "gleaming",
    "golden", "hollow", "humble", "icy", "jolly", "lively", "lucky", "mellow", "misty", "noble", "odd", "quiet",
    "rapid", "rustic", "silent", "silver", "smooth", "swift", "tender", "vivid", "wandering", "wild", "witty", "young",
)
_NOUNS = (
    "anchor", "badger", "beacon", "canyon", "cedar", "comet", "crane", "delta", "ember", "falcon", "fern", "harbor",
    "heron", "island", "lantern", "maple", "meadow", "otter", "pebble", "pine", "prairie", "quartz", "raven", "reef",
    "river", "saddle", "sparrow", "summit", "thistle", "tide", "tulip", "valley", "walnut", "willow", "wren", "zephyr",
)
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
#: Explicit response/channel boundaries: the answer is the text after the last one present.
RESPONSE_BOUNDARIES = (
    "</think>",
    "<|channel|>final<|message|>",
    "<|start_header_id|>assistant<|end_header_id|>",
    "<|im_start|>assistant",
)


def parse_niah_answer(text: str) -> tuple[str, ...]:
    """The ordered list of numbers in a generated answer (appendix 7.5).

    Steps: remove ``<think>...</think>`` blocks; keep the text after the last explicit response/channel boundary
    (:data:`RESPONSE_BOUNDARIES`); an unclosed ``<think>`` means the answer never left its thinking block (empty
    result); cut at the first end-of-turn token; return every maximal run of ASCII digits in order. Ordinary newlines
    do not truncate; repeats are kept; the gold list is never consulted.

    Args:
        text: decoded generation (``None`` is treated as empty).

    Returns:
        Tuple of digit strings (possibly empty).
    """
    if not text:
        return ()
    t = _THINK_BLOCK.sub(" ", text)
    cut = max((t.rfind(b) + len(b) if t.rfind(b) >= 0 else -1) for b in RESPONSE_BOUNDARIES)
    if cut >= 0:
        t = t[cut:]
    if "<think>" in t.lower():
        return ()
    for tok in END_OF_TURN_TOKENS:
        end = t.find(tok)
        if end >= 0:
            t = t[:end]
    return tuple(re.findall(r"[0-9]+", t))


def niah_exact_match(parsed: Sequence[str], gold: Sequence[str]) -> bool:
    """Strict EM: the parsed list equals the gold list in order and multiplicity (appendix 7.5)."""
    return tuple(parsed) == tuple(gold)


def niah_scorer(case: Any, text: str) -> bool:
    """Sweep scorer: strict EM of :func:`parse_niah_answer` ``(text)`` against ``case.gold``."""
    return niah_exact_match(parse_niah_answer(text), case.gold)


@dataclass(frozen=True)
class NiahCase:
    """One Erasing-NIAH case.

    Attributes:
        case_id: stable identifier (``niah-{context_len}-{index:03d}``).
        key: the needles' shared key (``adjective-noun``).
        values: the two values in order of appearance (7-digit strings).
        deleted: index in ``values`` of the deleted needle (0 = first, 1 = second).
        gold_original: the original context's answer (both values, in order).
        gold: the edited context's answer (the retained value).
        context_len: requested pre-query length, tokens.
        depths: the needles' depths in order of appearance (fraction of the filler tokens before them, in [0, 1]).
        documents: the original documents text.
        needle_char_spans: each needle sentence's ``(start, end)`` in the original pre-query text
            (``edit.original_text``).
        needle_token_spans: each needle sentence's ``(start, end)`` token span in ``edit.original_ids``.
        deleted_char_span: the deleted block's ``(start, end)`` in the original pre-query text (the needle and its
            blank-line separator; equals ``edit.deleted_char_span``).
        deleted_token_span: ``(p, p + d)`` in ``edit.original_ids``.
        kept_char_span: the retained needle sentence in ``edit.edited_text``.
        kept_token_span: the retained needle sentence's token span in ``edit.edited_ids``.
        seed: the case's own seed.
        edit: the edit (deleting ``deleted_char_span``), with the question as relevance query.
        answer_ids: the retained value's token ids as the model would write them right after the query
            (:func:`sur_lab.analysis.endpoints.canonical_answer_ids`: a leading space after RULER's answer prefix),
            teacher-forced for every record's ``gold_nll`` and ``gold_margin`` (issues 25, 26); ``None`` when built
            without a tokenizer-derived target.
    """

    case_id: str
    key: str
    values: tuple[str, str]
    deleted: int
    gold_original: tuple[str, ...]
    gold: tuple[str, ...]
    context_len: int
    depths: tuple[float, float]
    documents: str = field(repr=False)
    needle_char_spans: tuple[tuple[int, int], tuple[int, int]]
    needle_token_spans: tuple[tuple[int, int], tuple[int, int]]
    deleted_char_span: tuple[int, int]
    deleted_token_span: tuple[int, int]
    kept_char_span: tuple[int, int]
    kept_token_span: tuple[int, int]
    seed: int
    edit: EditedContext = field(repr=False)
    answer_ids: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        """N, tokens of the original pre-query sequence (chat template included)."""
        return self.edit.num_tokens

    @property
    def deleted_depth(self) -> float:
        """Depth of the deleted needle."""
        return self.depths[self.deleted]

    def meta(self) -> dict[str, Any]:
        """Flat scalars for sweep records: task, context length, depths, which needle was deleted, spans."""
        return {
            "dataset": "erasing-niah",
            "context_len": self.context_len,
            "num_tokens": self.num_tokens,
            "depth_first": self.depths[0],
            "depth_second": self.depths[1],
            "deleted_needle": "first" if self.deleted == 0 else "second",
            "deleted_depth": self.deleted_depth,
            "key": self.key,
            "gold_original": ",".join(self.gold_original),
            "deleted_token_start": self.deleted_token_span[0],
            "deleted_token_end": self.deleted_token_span[1],
            "kept_token_start": self.kept_token_span[0],
            "kept_token_end": self.kept_token_span[1],
        }

    def sweep_case(self):
        """This case as a :class:`sur_lab.sweeps.Case` (gold = the edited answer, meta = :meth:`meta`, answer target
        :attr:`answer_ids`)."""
        return Case(self.case_id, self.edit, self.gold, self.meta(), answer_ids=self.answer_ids)


def build_niah_case(
    tokenizer,
    corpus: Sequence[Any],
    *,
    context_len: int,
    depths: tuple[float, float],
    delete: int,
    seed: int,
    case_id: str | None = None,
    answer_prefix: bool = True,
) -> NiahCase:
    """Build one Erasing-NIAH case.

    Args:
        tokenizer: the target model's fast tokenizer (with a chat template).
        corpus: filler paragraphs with ``title`` and ``text`` (e.g. :func:`sur_lab.data.qa.load_corpus`).
        context_len: target pre-query length in tokens (>= 128); filler paragraphs are added in a seeded random
            order until the prompt reaches it (the result overshoots by less than one paragraph).
        depths: the two needles' depths, each in [0, 1], as fractions of the filler tokens before the needle; the
            needle with the smaller depth appears first (equal depths: the first given appears first). Each needle
            goes to the paragraph boundary nearest its depth.
        delete: which needle to delete, as an index into ``depths`` (0 or 1).
        seed: seed for the key, the values and the filler order.
        case_id: identifier (default ``niah-{context_len}-s{seed}``).
        answer_prefix: append RULER's answer prefix after the chat template's generation prompt.

    Returns:
        NiahCase whose ``edit`` deletes the chosen needle's block.

    Raises:
        ValueError: naming ``context_len`` (< 128), ``depths`` (outside [0, 1]), ``delete`` (not 0 or 1) or
            ``corpus`` (too small for ``context_len``), before any tokenization.
    """
    if int(context_len) != context_len or context_len < 128:
        raise ValueError(f"context_len must be an integer >= 128 tokens; got {context_len!r}")
    if len(depths) != 2 or not all(0.0 <= float(x) <= 1.0 for x in depths):
        raise ValueError(f"depths must be two fractions in [0, 1]; got {depths!r}")
    if delete not in (0, 1):
        raise ValueError(f"delete must be 0 or 1 (an index into depths); got {delete!r}")
    if len(corpus) == 0:
        raise ValueError("corpus is empty")
    rng = np.random.default_rng(seed)
    key = f"{_ADJECTIVES[rng.integers(len(_ADJECTIVES))]}-{_NOUNS[rng.integers(len(_NOUNS))]}"
    first_value = int(rng.integers(1_000_000, 10_000_000))
    second_value = first_value
    while second_value == first_value:
        second_value = int(rng.integers(1_000_000, 10_000_000))
    needle_values = (str(first_value), str(second_value))  # by index into ``depths``
    question = QUESTION_TEMPLATE.format(key=key)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    overhead = count(NIAH_INSTRUCTION) + 2 * count(NEEDLE_TEMPLATE.format(key=key, value=first_value)) + 40
    filler, lengths, filler_tokens = draw_filler(count, corpus, rng, context_len=context_len, overhead=overhead)
    if filler_tokens + overhead < context_len:
        raise ValueError(f"corpus has too few paragraphs ({len(corpus)}) for context_len={context_len}")
    # Insert each needle at the paragraph boundary whose filler-token depth is closest to the requested one.
    bounds = np.concatenate(([0], np.cumsum(lengths))) / max(1, filler_tokens)
    slots = [int(np.argmin(np.abs(bounds - float(x)))) for x in depths]
    # Indices into ``depths`` by appearance; needles sharing a slot keep their depth order.
    order = sorted(range(2), key=lambda i: (slots[i], float(depths[i]), i))
    blocks = list(filler)
    for i in reversed(order):
        blocks.insert(slots[i], NEEDLE_TEMPLATE.format(key=key, value=needle_values[i]))
    needle_block = {i: slots[i] + order.index(i) for i in range(2)}  # block index after insertion
    documents, spans = join_blocks(blocks)

    text, query_text, doc_start, containers = render_chat(tokenizer, documents, question, instruction=NIAH_INSTRUCTION)
    if answer_prefix:
        query_text = query_text + ANSWER_PREFIX_TEMPLATE.format(key=key)
    del_block = needle_block[delete]
    span = (doc_start + spans[del_block][0], doc_start + spans[del_block][1])
    # Token segments (head, one per paragraph, query): the edit never relies on a BPE merge across a boundary.
    edit = build_edit(tokenizer, text, query_text, span, question=question, containers=containers,
                      cuts=chat_cuts(text, doc_start, documents))

    offsets = edit.original_offsets
    needle_chars, needle_tokens = [], []
    block_starts = np.concatenate(([0], np.cumsum([len(b) + 2 for b in blocks])))
    for i in order:
        b = needle_block[i]
        start = doc_start + int(block_starts[b])
        end = start + len(blocks[b])
        needle_chars.append((start, end))
        needle_tokens.append(char_token_span(offsets, start, end))
    kept = 1 - order.index(delete)
    ks, ke = needle_chars[kept]
    width = span[1] - span[0]
    kept_chars = (ks, ke) if ke <= span[0] else (ks - width, ke - width)
    kt = needle_tokens[kept]
    kept_tokens = kt if kt[1] <= edit.prefix_len else (kt[0] - edit.deleted_len, kt[1] - edit.deleted_len)
    values = tuple(needle_values[i] for i in order)
    return NiahCase(
        case_id=case_id or f"niah-{context_len}-s{seed}",
        key=key,
        values=values,
        deleted=order.index(delete),
        gold_original=values,
        gold=(values[kept],),
        context_len=int(context_len),
        depths=tuple(float(depths[i]) for i in order),
        documents=documents,
        needle_char_spans=tuple(needle_chars),
        needle_token_spans=tuple(needle_tokens),
        deleted_char_span=span,
        deleted_token_span=(edit.prefix_len, edit.prefix_len + edit.deleted_len),
        kept_char_span=kept_chars,
        kept_token_span=kept_tokens,
        seed=int(seed),
        edit=edit,
        answer_ids=tuple(canonical_answer_ids(tokenizer, values[kept], query_text)),
    )


def build_niah_cases(
    tokenizer,
    *,
    context_lens: Sequence[int] = (1024,),
    depths: Sequence[float] = (0.25, 0.5, 0.75),
    num_cases: int = 4,
    seed: int = 0,
    corpus: Sequence[Any] | None = None,
) -> list[NiahCase]:
    """A roster of Erasing-NIAH cases cycling over context lengths and deleted-needle depths.

    Case i has context length ``context_lens[i % len(context_lens)]`` and deleted-needle depth
    ``depths[(i // len(context_lens)) % len(depths)]``. Deletion order alternates so that any roster is balanced: even
    cases delete the second needle, odd cases the first. The retained needle's depth is drawn uniformly on the side
    this requires, within [0.05, 0.95] and at least :data:`MIN_DEPTH_GAP` from the deleted one (the other side when
    that interval is empty). Every random choice of case i comes from ``SeedSequence([seed, i])``, so a case does not
    depend on ``num_cases`` and the roster is fixed before any model output is seen. The paper's grid is 96 cases over
    1K–32K tokens.

    Args:
        tokenizer: the target model's tokenizer.
        context_lens: pre-query lengths, tokens (each >= 128).
        depths: deleted-needle depths in [0, 1].
        num_cases: number of cases (>= 1).
        seed: roster seed.
        corpus: filler paragraphs (default: :func:`sur_lab.data.qa.load_corpus`).

    Raises:
        ValueError: naming ``num_cases``, ``context_lens`` or ``depths`` when empty or out of range (before any work).
    """
    if int(num_cases) != num_cases or num_cases < 1:
        raise ValueError(f"num_cases must be an integer >= 1; got {num_cases!r}")
    if not context_lens or any(int(c) != c or c < 128 for c in context_lens):
        raise ValueError(f"context_lens must be non-empty integers >= 128; got {context_lens!r}")
    if not depths or any(not 0.0 <= float(x) <= 1.0 for x in depths):
        raise ValueError(f"depths must be non-empty fractions in [0, 1]; got {depths!r}")
    if corpus is None:
        corpus = load_corpus()
    cases = []
    for i in range(int(num_cases)):
        ctx = int(context_lens[i % len(context_lens)])
        deleted_depth = float(depths[(i // len(context_lens)) % len(depths)])
        case_seed = int(np.random.SeedSequence([int(seed), i]).generate_state(1)[0])
        rng = np.random.default_rng([case_seed, 1])
        after = (deleted_depth + MIN_DEPTH_GAP, 0.95)  # the retained needle follows: the first is deleted
        before = (0.05, deleted_depth - MIN_DEPTH_GAP)  # the retained needle precedes: the second is deleted
        lo, hi = after if i % 2 else before
        if hi < lo:
            lo, hi = before if i % 2 else after
        kept_depth = float(np.round(rng.uniform(lo, hi), 3))
        cases.append(
            build_niah_case(
                tokenizer, corpus, context_len=ctx, depths=(deleted_depth, kept_depth), delete=0, seed=case_seed,
                case_id=f"niah-{ctx}-{i:03d}",
            )
        )
    return cases
