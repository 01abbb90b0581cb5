"""Query processing and greedy decoding from any repaired cache (Algorithm 1 step 11; Eq. 20's answer term)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .cache_ops import clone_cache
from .edits import EditedContext
from .forward import decode_step, forward_tokens
from .models import LoadedModel


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
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")


@torch.inference_mode()
def answer(
    lm: LoadedModel, cache: DynamicCache, edit: EditedContext, *, max_new_tokens: int = 64, copy: bool = True
) -> Answer:
    """Process ``edit.query_ids`` after ``cache`` and decode greedily until EOS or ``max_new_tokens``.

    Args:
        lm: the model.
        cache: a repaired pre-query cache (any method).
        edit: the edit, for its query.
        max_new_tokens: decoding limit, tokens (>= 1).
        copy: decode on a clone so ``cache`` is left unchanged (the clone is not timed, as a harness clone);
            ``False`` extends ``cache`` in place.

    Returns:
        Answer with text, ids, first-token logits and timings in ms.

    Raises:
        ValueError: if ``max_new_tokens`` < 1.
    """
    _check_max_new_tokens(max_new_tokens)
    work = clone_cache(cache) if copy else cache
    eos = set(lm.eos_token_ids)
    t0 = time.perf_counter()
    logits = forward_tokens(lm, edit.query_ids, work)
    t1 = time.perf_counter()
    first = logits.detach().float().cpu().clone()
    generated: list[int] = []
    finished = False
    for step in range(max_new_tokens):
        token = int(torch.argmax(logits))
        if token in eos:
            finished = True
            break
        generated.append(token)
        if step + 1 < max_new_tokens:
            logits = decode_step(lm, token, work)
    t2 = time.perf_counter()
    text = lm.tokenizer.decode(generated, skip_special_tokens=True).strip() if lm.tokenizer is not None else ""
    timings = {"query": (t1 - t0) * 1e3, "decode": (t2 - t1) * 1e3, "answer": (t2 - t0) * 1e3}
    return Answer(text, tuple(generated), first, finished, timings)


@torch.inference_mode()
def continuation_nll(lm: LoadedModel, cache: DynamicCache, edit: EditedContext, continuation: list[int]) -> float:
    """Negative log-likelihood (nats, summed) of ``continuation`` after the query, from a clone of ``cache``.

    Used to score how well a repaired cache predicts Re-prefill's greedy continuation (appendix 7.5).

    Raises:
        ValueError: if ``continuation`` is empty.
    """
    if len(continuation) == 0:
        raise ValueError("continuation must contain at least one token")
    work = clone_cache(cache)
    ids = torch.cat((edit.query_ids, torch.tensor(continuation[:-1], dtype=torch.long)))
    logits = forward_tokens(lm, ids, work, logits="all")[-len(continuation) :]
    logp = torch.log_softmax(logits.double(), dim=-1)
    target = torch.tensor(continuation, dtype=torch.long, device=logp.device)
    return float(-logp.gather(1, target[:, None]).sum())
