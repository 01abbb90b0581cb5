"""Query processing and greedy decoding from any repaired cache (Algorithm 1 step 11; Eq. 20's answer term).

:func:`greedy_answer` is the one greedy decoder of one cache. :class:`AnswerBatch` is its batched form: several
pre-query caches (of any lengths; shorter ones are left-padded and masked) are stacked along the batch dimension, the
query is forwarded once for all of them, greedy decoding runs with per-row stopping, and :meth:`AnswerBatch.score`
teacher-forces any target token sequence after the query for every row in one forward (the NLL endpoints). With one
cache it is the per-record path: the same forwards as :func:`greedy_answer`. Timings of a batch are the batch's; they
are per request only for a batch of one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from sur_lab.cache_ops import cache_length, clone_cache, crop_, slice_rows, stack_caches_
from sur_lab.checks import as_count, as_token_ids, check_vocab
from sur_lab.edits import EditedContext
from sur_lab.forward import decode_step, forward_batch, forward_tokens, one_context_warning
from sur_lab.models import LoadedModel


@dataclass(frozen=True)
class Answer:
    """A decoded answer.

    Attributes:
        text: decoded text without special tokens.
        token_ids: generated ids (the EOS token, if reached, is excluded).
        first_token_logits: ``[V]`` float32 logits after the query (CPU).
        finished: True when an EOS token ended decoding (False when ``max_new_tokens`` was reached).
        timings_ms: ``query`` (query processing), ``decode`` (greedy decoding), ``answer`` (their sum), ms; NaN for
            an answer of a batch of several rows (:class:`AnswerBatch`), whose time is not one request's.
    """

    text: str
    token_ids: tuple[int, ...]
    first_token_logits: torch.Tensor = field(repr=False)
    finished: bool
    timings_ms: dict[str, float] = field(default_factory=dict)


def _check_max_new_tokens(max_new_tokens: int) -> None:
    # True is not 1 token and 2.0 is not 2: a count must be an integer (issue 12, kind 5).
    as_count(max_new_tokens, "max_new_tokens", minimum=1)


@one_context_warning
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


def check_cache_rows(cache: DynamicCache, edit: EditedContext, name: str = "cache", *, note_tokens: int = 0) -> int:
    """The one check of a pre-query cache's length against its edit; returns the length (rows).

    A cache must hold the edited context's ``p + S`` rows (every repair of the deleted span) or the context before
    the edit, ``N - m`` rows (Dirty keeps the deleted span: N for a deletion; a replacement's Dirty cache lacks its m
    inserted tokens, ``edit.inserted_len``); a cache that appends a correction note of ``note_tokens`` = L > 0 tokens
    after the context before the edit (Erratum) holds ``N - m + L``. Any other length was built for another edit. This
    is the only place that knows which lengths an edit allows (the sweep groups caches by their actual length; the
    query is processed after a cache's last row, whatever its length).

    Raises:
        ValueError: naming ``name`` with its length and the lengths the edit allows.
    """
    rows = cache_length(cache)
    edited = edit.prefix_len + edit.suffix_len
    before = edit.num_tokens - edit.inserted_len
    allowed = (before + int(note_tokens),) if note_tokens else (edited, before)
    if rows not in allowed:
        what = (f"N - m + L = {before + int(note_tokens)} (the context before the edit and a {int(note_tokens)}-token "
                "note)") if note_tokens else (f"p + S = {edited} rows (repaired) or N - m = {before} (Dirty)")
        raise ValueError(f"{name} has {rows} rows; the edit's context has {what}: it was built for another edit")
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
        ValueError: if ``continuation`` is empty or holds an id outside ``[0, vocab_size)``, or naming ``cache`` as
            :func:`answer` does.
    """
    continuation = as_token_ids(continuation, "continuation", allow_empty=True)
    if continuation.numel() == 0:
        raise ValueError("continuation must contain at least one token")
    check_vocab(continuation, lm.spec.vocab_size, "continuation")
    check_cache_rows(cache, edit)
    work = clone_cache(cache)
    ids = torch.cat((edit.query_ids, continuation[:-1]))
    logits = forward_tokens(lm, ids, work, logits="all")[-len(continuation) :]
    logp = torch.log_softmax(logits.double(), dim=-1)
    target = continuation.to(logp.device)
    return float(-logp.gather(1, target[:, None]).sum())


class AnswerBatch:
    """Several pre-query caches answered together: the batched form of :func:`greedy_answer`.

    At construction the caches are stacked along the batch dimension (:func:`sur_lab.cache_ops.stack_caches_`; shorter
    caches left-padded with masked zero rows, each row keeping its own positions) and the query is forwarded once for
    all rows; :attr:`first_token_logits` holds each row's logits after the query. :meth:`decode` then decodes greedily
    with per-row stopping (EOS or ``max_new_tokens``), and :meth:`score` teacher-forces a target token sequence after
    the query for every row. Both start from the state right after the query (the rows they append are cropped off
    again), so they may be called in any order and :meth:`score` any number of times.

    Each row's results equal :func:`greedy_answer` on its cache alone up to the rounding of a batched forward (a batch of
    one makes exactly the same forwards).

    Args:
        lm: the model.
        caches: B >= 1 pre-query caches, each ``[1, H_kv, L_i, d_h]`` per layer (same layout).
        query_ids: ``[Q]`` int64, Q >= 1, the query appended to every row.
        copy: stack copies, leaving ``caches`` unchanged (default); ``False`` consumes them (the list is cleared and
            each cache emptied layer by layer while stacking, so peak memory is about one stacked copy).

    Attributes:
        first_token_logits: ``[B, V]`` float32 logits after the query (CPU).
        lengths: rows of each input cache.
        query_ms: wall time of the batched query forward, ms (per request only when B = 1).

    Raises:
        ValueError: naming ``caches`` (empty, not batch 1, layouts differ) or ``query_ids`` (empty, not 1-D, an id
            outside the vocabulary), before any forward.
    """

    @one_context_warning
    @torch.inference_mode()
    def __init__(self, lm: LoadedModel, caches: Sequence[DynamicCache], query_ids: torch.Tensor, *,
                 copy: bool = True) -> None:
        query_ids = as_token_ids(query_ids, "query_ids")
        if not len(caches):
            raise ValueError("caches is empty; answer at least one cache")
        self.lm = lm
        self.query_ids = query_ids.reshape(-1)
        self.lengths = [cache_length(c) for c in caches]
        self._stack(caches, copy)
        batch, q = len(self.lengths), int(self.query_ids.numel())
        longest = max(self.lengths)
        device = lm.device
        self._next = torch.tensor(self.lengths, dtype=torch.long, device=device)  # each row's next position
        self._base = longest + q
        t0 = time.perf_counter()
        logits = forward_batch(lm, self.query_ids.to(device).expand(batch, q), self._cache,
                               self._next[:, None] + torch.arange(q, device=device), self._extend_mask(q),
                               logits="last")
        self.query_ms = (time.perf_counter() - t0) * 1e3
        self._first = logits  # [B, V] on the model's device
        self._mask = self._extend_mask(q)
        self.first_token_logits = logits.detach().float().cpu().clone()

    @classmethod
    def queried(cls, lm: LoadedModel, caches: Sequence[DynamicCache], query_ids: torch.Tensor,
                first_token_logits: torch.Tensor, *, copy: bool = True) -> AnswerBatch:
        """A batch of caches whose query has already been forwarded, one request at a time: the per-request query
        forwards give time to first token, and decoding the rest of the answers is batched (a quality endpoint).

        Row i must be the cache ``greedy_answer(lm, cache_i, query_ids, max_new_tokens=1, copy=False)`` left behind:
        the pre-query rows followed by the query's ``Q`` rows, and ``first_token_logits[i]`` the logits it returned.
        :meth:`decode` and :meth:`score` then give each row what :func:`greedy_answer` on ``cache_i`` alone would, up
        to the rounding of a batched forward; the first token is exactly the unbatched one. :attr:`query_ms` is NaN
        (the query forwards were the caller's).

        Args:
            lm: the model.
            caches: B >= 1 post-query caches, ``[1, H_kv, L_i + Q, d_h]`` per layer; every cache with the same layer
                count, KV heads, head dim and dtype (lengths may differ: shorter ones are left-padded and masked).
            query_ids: ``[Q]`` integer ids (a tensor or a list), the query they hold.
            first_token_logits: ``[B, V]`` logits after the query (any float dtype, any device).
            copy: stack copies, leaving ``caches`` unchanged (default); ``False`` consumes them.

        Returns:
            The batch: :meth:`decode` and :meth:`score` as for a batch built from the pre-query caches.

        Raises:
            ValueError: naming ``caches`` (empty, a cache shorter than ``Q + 1`` rows, layouts differ) or
                ``first_token_logits`` (not ``[B, V]``), before any work.
        """
        query_ids = as_token_ids(query_ids, "query_ids").reshape(-1)
        q = int(query_ids.numel())
        if not len(caches):
            raise ValueError("caches is empty; answer at least one cache")
        totals = [cache_length(c) for c in caches]
        if min(totals) < q + 1:
            raise ValueError(f"caches hold {totals} rows; each must hold its context and the query's {q} rows")
        vocab = lm.spec.vocab_size
        if tuple(first_token_logits.shape) != (len(caches), vocab):
            raise ValueError(f"first_token_logits has shape {tuple(first_token_logits.shape)}; expected "
                             f"({len(caches)}, {vocab})")
        self = cls.__new__(cls)
        self.lm = lm
        self.query_ids = query_ids
        self.lengths = [t - q for t in totals]
        self._stack(caches, copy)
        device = lm.device
        self._next = torch.tensor(self.lengths, dtype=torch.long, device=device)
        self._base = max(totals)
        self.query_ms = math.nan
        self._first = first_token_logits.to(device)
        self.first_token_logits = first_token_logits.detach().float().cpu().clone()
        return self

    def _stack(self, caches: Sequence[DynamicCache], copy: bool) -> None:
        """Stack ``caches`` (copies when ``copy``) into ``self._cache``; ``self._mask`` hides the left padding (None
        when no row is padded: the unbatched forward's own path)."""
        work = [clone_cache(c) for c in caches] if copy else caches
        self._cache, pads = stack_caches_(work)
        self._mask = None
        if any(pads):
            device = self.lm.device
            width = cache_length(self._cache)
            self._mask = torch.arange(width, device=device)[None, :] >= torch.tensor(pads, device=device)[:, None]

    def __len__(self) -> int:
        return len(self.lengths)

    def _extend_mask(self, extra: int) -> torch.Tensor | None:
        if self._mask is None:
            return None
        return torch.cat((self._mask, self._mask.new_ones(self._mask.shape[0], extra)), dim=1)

    def _restore(self) -> None:
        """Back to the state right after the query (rows appended by decode or score dropped)."""
        if cache_length(self._cache) != self._base:
            crop_(self._cache, self._base)

    @one_context_warning
    @torch.inference_mode()
    def decode(self, max_new_tokens: int = 64) -> list[Answer]:
        """Greedy decoding of every row until its EOS or ``max_new_tokens``: :func:`greedy_answer`'s rule per row.

        Finished rows stay in the batch (fed their last argmax, their outputs ignored) until every row has stopped.

        Returns:
            One :class:`Answer` per row, in input order; ``timings_ms`` per request when B = 1, NaN otherwise (the
            batch's wall times are :attr:`query_ms` and the ``decode_ms`` attribute set here).

        Raises:
            TypeError, ValueError: for ``max_new_tokens`` as :func:`greedy_answer`.
        """
        _check_max_new_tokens(max_new_tokens)
        self._restore()
        lm, batch, device = self.lm, len(self), self.lm.device
        eos = set(lm.eos_token_ids)
        generated: list[list[int]] = [[] for _ in range(batch)]
        finished = [False] * batch
        active = [True] * batch
        mask = self._mask
        current = self._first
        t0 = time.perf_counter()
        for step in range(int(max_new_tokens)):
            tokens = torch.argmax(current, dim=-1).tolist()
            for i in range(batch):
                if not active[i]:
                    continue
                if tokens[i] in eos:
                    finished[i], active[i] = True, False
                    continue
                generated[i].append(tokens[i])
                if step + 1 >= max_new_tokens:
                    active[i] = False
            if not any(active):
                break
            feed = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
            positions = self._next[:, None] + (int(self.query_ids.numel()) + step)
            if mask is not None:
                mask = torch.cat((mask, mask.new_ones(batch, 1)), dim=1)
            current = forward_batch(lm, feed, self._cache, positions, mask, logits="last")
        self.decode_ms = (time.perf_counter() - t0) * 1e3
        self._restore()
        if batch == 1:
            timings = {"query": self.query_ms, "decode": self.decode_ms, "answer": self.query_ms + self.decode_ms}
        else:
            timings = {"query": math.nan, "decode": math.nan, "answer": math.nan}
        out = []
        for i in range(batch):
            text = lm.tokenizer.decode(generated[i], skip_special_tokens=True).strip() if lm.tokenizer is not None else ""
            out.append(Answer(text, tuple(generated[i]), self.first_token_logits[i], finished[i], dict(timings)))
        return out

    @one_context_warning
    @torch.inference_mode()
    def score(self, target: Sequence[int] | torch.Tensor) -> np.ndarray:
        """Teacher-forced log-probabilities of ``target`` after the query, for every row: one batched forward.

        Token t of the target is scored by the logits after the query and ``target[:t]`` (the first token by
        :attr:`first_token_logits`). The forward of ``target[:-1]`` is cropped off afterwards.

        Args:
            target: ``[T]`` token ids (T >= 0).

        Returns:
            ``[B, T]`` float64 log-probabilities (``log_softmax`` of the float32 logits, in float64); ``[B, 0]`` for
            an empty target. The NLL of row b is ``-out[b].sum()`` nats.

        Raises:
            TypeError: if ``target`` holds non-integer ids.
            ValueError: if an id lies outside the vocabulary.
        """
        target = as_token_ids(list(target) if not isinstance(target, torch.Tensor) else target, "target",
                              allow_empty=True).reshape(-1)
        check_vocab(target, self.lm.spec.vocab_size, "target")
        batch, length = len(self), int(target.numel())
        out = np.zeros((batch, length), dtype=np.float64)
        if length == 0:
            return out
        self._restore()
        tgt = target.to(self.lm.device)
        rows = [self._first]  # [B, V] scores target[0]
        if length > 1:
            q = int(self.query_ids.numel())
            positions = self._next[:, None] + q + torch.arange(length - 1, device=self.lm.device)
            logits = forward_batch(self.lm, tgt[:-1].expand(batch, length - 1), self._cache, positions,
                                   self._extend_mask(length - 1), logits="all")  # [B, T - 1, V]
            self._restore()
        for b in range(batch):
            # One row at a time: a [T, V] float64 log-softmax, not [B, T, V].
            scores = rows[0][b : b + 1] if length == 1 else torch.cat((rows[0][b : b + 1], logits[b]), dim=0)
            logp = torch.log_softmax(scores.double(), dim=-1)
            out[b] = logp.gather(1, tgt[:, None]).squeeze(1).cpu().numpy()
        return out


def greedy_answers(lm: LoadedModel, caches: Sequence[DynamicCache], query_ids: torch.Tensor, *,
                   max_new_tokens: int = 64) -> list[Answer]:
    """:func:`greedy_answer` for several caches at once (:class:`AnswerBatch`): one query forward, batched greedy
    decoding with per-row stopping. The caches are not modified.

    Returns:
        One :class:`Answer` per cache, in order (timings per request only for a single cache).

    Raises:
        ValueError, TypeError: as :class:`AnswerBatch` and :func:`greedy_answer`.
    """
    _check_max_new_tokens(max_new_tokens)
    return AnswerBatch(lm, caches, query_ids).decode(max_new_tokens)
