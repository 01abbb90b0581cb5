"""Text helpers the studies share: source generators, eligibility, block joining and sentence truncation.

- :class:`PanelConfig` and :func:`is_eligible`: which QA sources can supply placement cases (annotations only, no model
  output; section 4.3, appendix 7.5), and how their documents are framed.
- :func:`source_rng`: the per-source generator, seeded by ``(seed, crc32("dataset/id"))``, so a source's draws do not
  depend on the panel size.
- :func:`join_blocks`: text blocks joined with blank lines, with each block's deletable span.
- :func:`truncate_text`: a passage cut to whole sentences (pysbd) that fit a token cap.

Part of the data layer: it imports the core and :mod:`sur_lab.data.qa` only (``tests/test_layout.py``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sur_lab.data.qa import QAExample
from sur_lab.edits import DEFAULT_INSTRUCTION
from sur_lab.units import _segmenter

# ---------------------------------------------------------------------------------------------------------------------
# Sources: eligibility and the per-source generator


@dataclass(frozen=True)
class PanelConfig:
    """How sources are chosen and how their documents are built (the natural-QA placement cases: section 4.3, appendix 7.5).

    Attributes:
        lead: framing non-supporting passages before the evidence in the clean document (>= 0).
        tail: framing non-supporting passages after the evidence (>= 0; 0 gives an empty suffix after support).
        min_supporting: sources need at least this many supporting passages (>= 2, so "between" exists).
        include_unanswerable: keep IIRC questions whose answer type is "none".
        seed: seeds the source selection (:func:`sur_lab.data.qa.select_sources`) and each source's passage draw.
        instruction: text before the documents in the user message.

    Raises:
        ValueError: naming ``lead``/``tail`` when negative or ``min_supporting`` when below 2.
    """

    lead: int = 0
    tail: int = 1
    min_supporting: int = 2
    include_unanswerable: bool = False
    seed: int = 0
    instruction: str = DEFAULT_INSTRUCTION

    def __post_init__(self) -> None:
        for name in ("lead", "tail"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an integer >= 0")
        if int(self.min_supporting) != self.min_supporting or self.min_supporting < 2:
            raise ValueError(f"min_supporting={self.min_supporting!r} must be an integer >= 2 (placement 'between')")


def is_eligible(example: QAExample, config: PanelConfig = PanelConfig()) -> bool:
    """Whether ``example`` can supply three placement cases under ``config`` (annotations only, no model output)."""
    if len(example.supporting) < config.min_supporting:
        return False
    return config.include_unanswerable or example.answer_type != "none"


def source_rng(example: QAExample, seed: int) -> np.random.Generator:
    """The per-source generator: PCG64 seeded by ``(seed, crc32("dataset/id"))``, independent of panel size."""
    return np.random.default_rng([int(seed), zlib.crc32(f"{example.dataset}/{example.id}".encode())])


# ---------------------------------------------------------------------------------------------------------------------
# Text blocks and sentences


def join_blocks(blocks: Sequence[str]) -> tuple[str, list[tuple[int, int]]]:
    """Join text blocks with blank lines; block i's deletable span includes one separator.

    Returns:
        ``(documents, spans)``: ``spans[i]`` covers block i and the blank line after it (the last block: the blank line
        before it), so deleting ``spans[i]`` leaves exactly ``join_blocks`` of the other blocks.
    """
    spans, pos = [], 0
    for i, block in enumerate(blocks):
        sep = 2 if i < len(blocks) - 1 else 0
        spans.append((pos, pos + len(block) + sep))
        pos += len(block) + sep
    if len(blocks) > 1:
        spans[-1] = (spans[-1][0] - 2, pos)
    return "\n\n".join(blocks), spans


def char_token_span(offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """The tokens that carry characters of ``[start, end)``: ``(first, last + 1)``, a token merged across either end
    (such as Qwen's ``".\n\n"``) included, empty tokens (offsets ``(a, a)``) skipped.

    Args:
        offsets: per-token ``(start, end)`` character offsets of the text (a tokenizer's offset mapping).
        start, end: the character range; ``start`` is ``-1`` when a ``str.find`` missed.

    Raises:
        ValueError: naming ``start`` when it is negative (the block is not in the text).
    """
    if start < 0:
        raise ValueError(f"start={start}: the block is not in the text")
    first = next(i for i, (a, b) in enumerate(offsets) if b > start and b > a)
    last = max(i for i, (a, b) in enumerate(offsets) if a < end and b > a)
    return first, last + 1


def _sentences(text: str) -> list[str]:
    """Sentences of ``text`` (pysbd, English), whitespace kept so that joining them restores the text."""
    return _segmenter().segment(text)


def truncate_text(tokenizer, title: str, text: str, max_tokens: int) -> str:
    """Shorten ``text`` so that the block ``"Title: {title}\\n{text}"`` has at most ``max_tokens`` tokens.

    Whole sentences (pysbd) are kept while they fit; if even the first sentence does not fit, it is cut at the last
    token boundary that fits. Used to bound prompt length on CPU; the contract (full prefill of the same prompt is the
    reference) is unaffected.

    Raises:
        ValueError: naming ``max_tokens`` when it is < 8.
    """
    if max_tokens < 8:
        raise ValueError(f"max_tokens={max_tokens!r} must be >= 8")
    head = f"Title: {title}\n"
    count = lambda s: len(tokenizer(head + s, add_special_tokens=False)["input_ids"])  # noqa: E731
    text = text.strip()
    if count(text) <= max_tokens:
        return text
    kept = ""
    for sent in _sentences(text):
        candidate = kept + sent
        if count(candidate.strip()) > max_tokens:
            break
        kept = candidate
    if kept.strip():
        return kept.strip()
    enc = tokenizer(head + text, add_special_tokens=False, return_offsets_mapping=True)
    end = enc["offset_mapping"][max_tokens - 1][1]
    cut = (head + text)[:end][len(head):]
    # A cut inside the first token of the text leaves nothing: keep the first word rather than an empty document.
    return cut.strip() or text.split()[0]


def passage_block(tokenizer, passages: Sequence, max_tokens: int) -> str:
    """Passages as one tool-output block: each a ``Title: <title>`` line, then its text cut to whole sentences within
    ``max_tokens`` (:func:`truncate_text`); blocks separated by a blank line.

    Args:
        tokenizer: the model's tokenizer (token counts).
        passages: objects with ``title`` and ``text`` (:class:`sur_lab.data.qa.Passage`).
        max_tokens: the per-passage token cap (as :func:`truncate_text`).
    """
    return "\n\n".join(f"Title: {p.title}\n{truncate_text(tokenizer, p.title, p.text, max_tokens)}" for p in passages)


__all__ = ["PanelConfig", "char_token_span", "is_eligible", "join_blocks", "passage_block", "source_rng",
           "truncate_text"]


def draw_filler(count: Callable[[str], int], corpus: Sequence, rng: np.random.Generator, *, context_len: int,
                overhead: int, ceiling: float | None = None,
                skip: Callable[[str], bool] | None = None) -> tuple[list[str], list[int], int]:
    """Filler passages for a synthetic context (Erasing-NIAH, stale facts): ``"Title: ...\n<text>"`` blocks of
    ``corpus`` (objects with ``title`` and ``text``) in ``rng``'s random order, taken until they and ``overhead``
    tokens reach ``context_len``.

    Args:
        count: the tokens of a text (the study's tokenizer, no special tokens); each block counts one more (its
            separator).
        ceiling: when given, a block that would take the total past it is passed over (tokens).
        skip: when given, a block for which it returns True is passed over (e.g. one that names a case's key).

    Returns:
        ``(blocks, lengths, total)``: the blocks in drawn order, their token counts (separator included) and their
        sum. The caller checks that the total is long enough (the corpus may run out).
    """
    blocks, lengths, total = [], [], 0
    for idx in rng.permutation(len(corpus)):
        if total + overhead >= context_len:
            break
        p = corpus[int(idx)]
        block = f"Title: {p.title}\n{p.text.strip()}"
        n = count(block) + 1
        if (ceiling is not None and total + overhead + n > ceiling) or (skip is not None and skip(block)):
            continue
        blocks.append(block)
        lengths.append(n)
        total += n
    return blocks, lengths, total
