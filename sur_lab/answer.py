"""Query processing and greedy decoding from any repaired cache (Algorithm 1 step 11; Eq. 20's answer term)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from sur_lab.cache_ops import cache_length, clone_cache, slice_rows
from sur_lab.checks import as_count, as_token_ids
from sur_lab.edits import EditedContext
from sur_lab.forward import decode_step, forward_tokens
from sur_lab.models import LoadedModel


@dataclass(frozen=True)
class Answer:
    """A decoded answer.

    Attributes:
        text: decoded text without special tokens.
        token_ids: generated ids (the EOS token, if reached, is excluded).
        first_token_logits: ``[V]`` float32 logits after the query (CPU).
        finished: True when an EOS token ended decoding (False when ``max_new_tokens`` was reached).
        timings_ms: ``query`` (query processing), ``decode`` (greedy decoding), ``answer`` (their sum), ms.
    """

    text: str
    token_ids: tuple[int, ...]
    first_token_logits: torch.Tensor = field(repr=False)
    finished: bool
    timings_ms: dict[str, float] = field(default_factory=dict)


def _check_max_new_tokens(max_new_tokens: int) -> None:
    # True is not 1 token and 2.0 is not 2: a count must be an integer (issue 12, kind 5).
    as_count(max_new_tokens, "max_new_tokens", minimum=1)


@torch.inference_mode()
def greedy_answer(
    lm: LoadedModel,
    cache: DynamicCache,
    query_ids: torch.Tensor,
    *,
    max_new_tokens: int = 64,
    draft: Sequence[int] = (),
    copy: bool = True,
) -> Answer:
    """Process ``query_ids`` after ``cache`` and decode greedily until EOS or ``max_new_tokens``: the one greedy decoder.

    Without a draft: the query is forwarded (its time is ``timings_ms["query"]``, the first logit) and the answer is
    decoded step by step. With a draft (e.g. full prefill's answer tokens), the query and the draft are forwarded
    together and the draft tokens are accepted while each is the argmax of the previous position's logits; at the first
    divergence the draft rows are dropped and decoding continues step by step. The result is the plain greedy decode
    up to float reassociation between a multi-token and a one-token forward; a preserved answer costs one forward
    instead of one per token. ``timings_ms["query"]`` then includes the draft tokens, so time to first logit should use
    a draft-free query forward.

    Args:
        lm: the model.
        cache: pre-query cache (any method).
        query_ids: ``[Q]`` int64, Q >= 1.
        max_new_tokens: decoding limit, tokens (>= 1).
        draft: token ids to verify (tokens).
        copy: decode on a clone so ``cache`` is left unchanged (the clone is not timed, as a harness clone);
            ``False`` extends ``cache`` in place (not allowed with a draft, whose rejected rows are cut off).

    Returns:
        Answer with text, ids, first-token logits (float32 ``[V]``, CPU) and ``timings_ms`` ``query``, ``decode`` and
        ``answer`` (ms).

    Raises:
        TypeError: if ``max_new_tokens`` is not an integer (``True``, ``None``, ``2.0``), or ``draft`` holds
            non-integer ids.
        ValueError: if ``max_new_tokens`` < 1, or ``copy=False`` with a ``draft``.
    """
    _check_max_new_tokens(max_new_tokens)
    draft = as_token_ids(list(draft) if not isinstance(draft, torch.Tensor) else draft, "draft", allow_empty=True)
    draft = draft.tolist()[:max_new_tokens]
    if draft and not copy:
        raise ValueError("copy=False cannot be combined with a draft (rejected draft rows are cut from a new cache)")
    work = clone_cache(cache) if copy else cache
    eos = set(lm.eos_token_ids)
    base = cache_length(work) + int(query_ids.numel())
    t0 = time.perf_counter()
    ids = torch.cat((query_ids.reshape(-1), torch.tensor(draft, dtype=torch.long))) if draft else query_ids.reshape(-1)
    # [m + 1, V]: logits after the query, then after each draft token.
    logits = forward_tokens(lm, ids, work, logits=len(draft) + 1)
    t1 = time.perf_counter()
    first = logits[0].detach().float().cpu().clone()
    drafted = len(draft)
    generated: list[int] = []
    finished = False
    current = logits[0]
    for step in range(int(max_new_tokens)):
        token = int(torch.argmax(current))
        if token in eos:
            finished = True
            break
        generated.append(token)
        if step + 1 >= max_new_tokens:
            break
        if drafted and step < drafted and token == draft[step]:
            current = logits[step + 1]
            continue
        if drafted:
            # Diverged from (or ran past) the draft: keep the rows of the accepted inputs draft[:step] only.
            work = slice_rows(work, 0, base + step)
            drafted = 0
        current = decode_step(lm, token, work)
    t2 = time.perf_counter()
    text = lm.tokenizer.decode(generated, skip_special_tokens=True).strip() if lm.tokenizer is not None else ""
    timings = {"query": (t1 - t0) * 1e3, "decode": (t2 - t1) * 1e3, "answer": (t2 - t0) * 1e3}
    return Answer(text, tuple(generated), first, finished, timings)


def check_cache_rows(cache: DynamicCache, edit: EditedContext, name: str = "cache") -> int:
    """The one check of a pre-query cache's length against its edit; returns the length (rows).

    A cache must hold the edited context's ``p + S`` rows (every repair of the deleted span) or the original
    ``N = p + d + S`` rows (Dirty keeps the deleted span); any other length was built for another edit. This is the
    only place that knows which lengths an edit allows: a reference operator whose cache has another length (e.g. the
    Dirty cache followed by a prefilled correction note) extends this check, and nothing else (the sweep groups caches
    by their actual length; the query is processed after a cache's last row, whatever its length).

    Raises:
        ValueError: naming ``name`` with its length and the lengths the edit allows.
    """
    rows = cache_length(cache)
    edited = edit.prefix_len + edit.suffix_len
    if rows not in (edited, edit.num_tokens):
        raise ValueError(
            f"{name} has {rows} rows; the edit's context has p + S = {edited} rows (repaired) or N = {edit.num_tokens} "
            "(Dirty): it was built for another edit"
        )
    return rows


def answer(
    lm: LoadedModel, cache: DynamicCache, edit: EditedContext, *, max_new_tokens: int = 64, copy: bool = True
) -> Answer:
    """Process ``edit.query_ids`` after ``cache`` and decode greedily (:func:`greedy_answer` with the edit's query).

    Args:
        lm: the model.
        cache: a repaired pre-query cache (any method): ``p + S`` rows, or ``N = p + d + S`` for Dirty
            (:func:`check_cache_rows`).
        edit: the edit, for its query.
        max_new_tokens: decoding limit, tokens (>= 1).
        copy: decode on a clone so ``cache`` is left unchanged (the clone is not timed, as a harness clone);
            ``False`` extends ``cache`` in place.

    Returns:
        Answer with text, ids, first-token logits and timings in ms.

    Raises:
        TypeError: if ``max_new_tokens`` is not an integer (``True``, ``None``, ``2.0``).
        ValueError: if ``max_new_tokens`` < 1, or naming ``cache`` when its length fails :func:`check_cache_rows`
            (a cache built for another edit).
    """
    check_cache_rows(cache, edit)
    return greedy_answer(lm, cache, edit.query_ids, max_new_tokens=max_new_tokens, copy=copy)


@torch.inference_mode()
def continuation_nll(lm: LoadedModel, cache: DynamicCache, edit: EditedContext, continuation: list[int]) -> float:
    """Negative log-likelihood (nats, summed) of ``continuation`` after the query, from a clone of ``cache``.

    Used to score how well a repaired cache predicts Re-prefill's greedy continuation (appendix 7.5).

    Raises:
        TypeError: if ``continuation`` holds non-integer ids.
        ValueError: if ``continuation`` is empty, or naming ``cache`` as :func:`answer` does.
    """
    continuation = as_token_ids(continuation, "continuation", allow_empty=True)
    if continuation.numel() == 0:
        raise ValueError("continuation must contain at least one token")
    check_cache_rows(cache, edit)
    work = clone_cache(cache)
    ids = torch.cat((edit.query_ids, continuation[:-1]))
    logits = forward_tokens(lm, ids, work, logits="all")[-len(continuation) :]
    logp = torch.log_softmax(logits.double(), dim=-1)
    target = continuation.to(logp.device)
    return float(-logp.gather(1, target[:, None]).sum())
