"""Inputs of the refresh-time benchmarks (section 4.4, appendix 13.3): the synthetic random-token edits and their
Shift caches (:func:`prepare_context`), the matched-work supports of B positions in R intervals with an identical
causal pair count M(U) at every R (:func:`matched_support`), and the natural-text edit of the overlap comparison
(:func:`text_edit`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from sur_lab.budget import Support
from sur_lab.edits import EditedContext, build_edit, token_edit
from sur_lab.executors import dirty, shift
from sur_lab.models import LoadedModel

#: Tokens before the deleted span (p) and deleted tokens (d) of the synthetic edits: an edited context of N tokens is
#: prefilled Dirty as N + d tokens, which must fit the model's ``max_position_embeddings``.
PREFIX_LEN = 16
DELETED_LEN = 8

__all__ = [
    "BenchContext",
    "DELETED_LEN",
    "PREFIX_LEN",
    "matched_support",
    "prepare_context",
    "synthetic_edit",
    "text_edit",
]


def synthetic_edit(
    vocab_size: int,
    context_len: int,
    *,
    deleted_len: int = DELETED_LEN,
    prefix_len: int = PREFIX_LEN,
    query_len: int = 8,
    seed: int = 0,
) -> EditedContext:
    """A random-token edit whose edited context has ``context_len`` tokens (appendix 13.3).

    Args:
        vocab_size: token ids are drawn uniformly from ``[0, vocab_size)``.
        context_len: N = p + S, tokens of the edited context (the Shift cache's rows).
        deleted_len: d, tokens deleted after the prefix (8 in the paper).
        prefix_len: p, tokens before the deleted span.
        query_len: random query tokens (for query-logit checks).
        seed: generator seed.

    Raises:
        ValueError: naming ``context_len`` if it does not exceed ``prefix_len``, or ``deleted_len``/``query_len``
            below 1.
    """
    if context_len <= prefix_len or prefix_len < 0:
        raise ValueError(f"context_len={context_len} must exceed prefix_len={prefix_len} >= 0")
    if deleted_len < 1 or query_len < 1:
        raise ValueError(f"deleted_len={deleted_len} and query_len={query_len} must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (context_len + deleted_len,), generator=gen)
    query = torch.randint(0, vocab_size, (query_len,), generator=gen)
    return token_edit(ids, prefix_len, deleted_len, query)


def matched_support(
    context_len: int, prefix_len: int, num_selected: int, num_intervals: int, *, spread: float = 0.875
) -> Support:
    """B positions in R equal intervals, symmetric about the middle of the edited context, so M(U) = B (N + 1) / 2.

    Interval i starts at ``lo + i * step`` (absolute), with ``2 lo + (R - 1) step = N - B / R`` so that the set is
    mirror-symmetric about ``(N - 1) / 2``; ``step`` is about ``spread * S / R`` (made even when parity requires).
    Every R therefore has the same causal pair count M(U) (section 4.4: "matching causal query-key pair counts
    within each length").

    Args:
        context_len: N = p + S.
        prefix_len: p; every position must lie in the suffix.
        num_selected: B, a multiple of ``num_intervals``.
        num_intervals: R >= 1.
        spread: fraction of the suffix the intervals span, in (0, 1].

    Returns:
        Suffix-local support (``suffix_len = N - p``) with exactly R intervals.

    Raises:
        ValueError: naming ``num_selected`` (not a multiple of R, or too many), ``spread`` (outside (0, 1]) or
            ``context_len`` (no symmetric placement inside the suffix).
    """
    n, p, b, r = int(context_len), int(prefix_len), int(num_selected), int(num_intervals)
    if r < 1 or b < r or b % r:
        raise ValueError(f"num_selected={b} must be a positive multiple of num_intervals={r}")
    if not 0.0 < spread <= 1.0:
        raise ValueError(f"spread={spread} must be in (0, 1]")
    length = b // r
    step = 0
    if r > 1:
        step = max(length + 1, int(spread * (n - p) / r))
        if (n - length - (r - 1) * step) % 2:
            step += 1  # flips the parity only when R - 1 is odd; checked below
    rest = n - length - (r - 1) * step
    lo = rest // 2
    if rest % 2 or lo < p:
        raise ValueError(
            f"context_len={n}: no mirror-symmetric placement of {r} intervals of {length} inside the suffix [{p}, {n})"
        )
    starts = lo + step * np.arange(r)
    absolute = (starts[:, None] + np.arange(length)[None, :]).reshape(-1)
    support = Support(absolute - p, n - p)
    assert support.num_intervals == r and 2 * int(np.sum(absolute + 1)) == b * (n + 1)
    return support


@dataclass(frozen=True, eq=False)
class BenchContext:
    """One prepared context length: the edit and its Shift cache (``[1, H_kv, N, d_h]`` per layer).

    Attributes:
        edit: the synthetic edit.
        shift: its Shift cache (never modified by the executors).
        context_len: N, tokens.
        prepare_ms: Dirty prefill + Shift wall time (ms), for the record.
    """

    edit: EditedContext
    shift: DynamicCache
    context_len: int
    prepare_ms: float = field(default=float("nan"))


def prepare_context(
    lm: LoadedModel, context_len: int, *, deleted_len: int = DELETED_LEN, prefix_len: int = PREFIX_LEN, seed: int = 0
):
    """Build the synthetic edit for ``context_len`` and its Shift cache (one Dirty prefill of N + d tokens).

    Args:
        lm: the model (the edit's tokens are drawn from its vocabulary).
        context_len: N, tokens of the edited context.
        deleted_len, prefix_len, seed: as :func:`synthetic_edit`.

    Returns:
        :class:`BenchContext` with ``prepare_ms`` the wall time of the prefill and Shift (ms).

    Raises:
        ValueError: see :func:`synthetic_edit`.
    """
    edit = synthetic_edit(lm.spec.vocab_size, context_len, deleted_len=deleted_len, prefix_len=prefix_len, seed=seed)
    t0 = time.perf_counter()
    dirty_cache = dirty(lm, edit)
    shift_cache = shift(lm, dirty_cache, edit)
    del dirty_cache
    return BenchContext(edit, shift_cache, context_len, (time.perf_counter() - t0) * 1e3)


_SENTENCES = (
    "The survey team measured the river at {place} on day {i}, and the water stood {n} centimetres above the mark.",
    "Officials in {place} said the bridge would reopen after inspection number {i} found only minor cracks.",
    "A local archive lists {n} letters sent from {place}, most of them about grain prices and the spring fair.",
    "Record {i} notes that the mill near {place} changed owners twice before the railway arrived.",
)
_PLACES = ("Alder Ford", "Brindle Cove", "Cobalt Hill", "Dunmere", "Elm Reach", "Fallowby", "Glenwick", "Harrowgate")


def text_edit(lm: LoadedModel, context_tokens: int, *, seed: int = 0) -> EditedContext:
    """A natural-text edit of about ``context_tokens`` tokens for the overlap benchmark (appendix 13.3).

    Paragraphs of four template sentences (blank lines between paragraphs) so that SUR's units come from real
    sentence and paragraph boundaries; the second sentence of the first paragraph is deleted; the query asks about
    one place.

    Raises:
        ValueError: naming ``context_tokens`` when below 64, or ``lm`` when it has no tokenizer.
    """
    if context_tokens < 64:
        raise ValueError(f"context_tokens={context_tokens} must be >= 64")
    if lm.tokenizer is None:
        raise ValueError("lm has no tokenizer; text_edit needs one (offsets)")
    rng = np.random.default_rng(seed)
    paragraphs, tokens, i = [], 0, 0
    while tokens < context_tokens:
        sentences = []
        for template in _SENTENCES:
            i += 1
            sentences.append(template.format(place=_PLACES[rng.integers(len(_PLACES))], i=i, n=rng.integers(10, 999)))
        paragraph = " ".join(sentences)
        paragraphs.append(paragraph)
        tokens += len(lm.tokenizer(paragraph + "\n\n", add_special_tokens=False)["input_ids"])
    text = "\n\n".join(paragraphs) + "\n\n"
    first = paragraphs[0]
    start = first.index(". ") + 1  # delete " <second sentence>." so the cut falls on token boundaries
    end = first.index(". ", start + 1) + 1
    question = f"What happened at {_PLACES[int(rng.integers(len(_PLACES)))]}?"
    return build_edit(lm.tokenizer, text, question, (start, end), question=question)
