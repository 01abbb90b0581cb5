"""Ordinary model forwards against a cache: prefill and appending tokens at explicit positions.

Phases are named for what they are: ``prefill`` builds a cache from an empty one, ``forward_tokens`` appends tokens
at given positions to an existing cache (query processing, interval replay), ``decode_step`` appends one token, and
``forward_batch`` appends tokens to a batch of sequences at once (batched answering, :mod:`sur_lab.answer`).

Context length. Every forward that grows a context runs through :func:`forward_tokens` or :func:`forward_batch`
(prefill, decoding, query processing, Replay and Re-prefill, :class:`sur_lab.session.EditSession` appends and
replacements, batched answering); they and the packed executors' traversals call :func:`check_context_length`, which
warns (:class:`ContextLengthWarning`, a ``UserWarning``) when a position reaches past the model's
``max_position_embeddings``. A public call that runs many forwards (``answer`` decoding token by token, a repair, a
session edit) is wrapped in :func:`one_context_warning`, so it warns once, not once per forward.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
from transformers import DynamicCache

from sur_lab.cache_ops import cache_length
from sur_lab.checks import check_batch_one, check_vocab, user_stacklevel
from sur_lab.models import LoadedModel


class ContextLengthWarning(UserWarning):
    """A forward computed positions at or past the model's ``max_position_embeddings`` (not trained there)."""


# Per calling context (thread / task): None outside any one_context_warning call, else [warned already?].
_WARN_SCOPE: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("sur_lab_context_warning", default=None)

_F = TypeVar("_F", bound=Callable)


def one_context_warning(fn: _F) -> _F:
    """Decorator: within one call of ``fn`` (and everything it calls), :func:`check_context_length` warns at most once.

    Nested decorated calls share the outermost call's scope. Per calling context, so threads do not share it.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _WARN_SCOPE.get() is not None:
            return fn(*args, **kwargs)
        token = _WARN_SCOPE.set([False])
        try:
            return fn(*args, **kwargs)
        finally:
            _WARN_SCOPE.reset(token)

    return wrapper  # type: ignore[return-value]


def check_context_length(lm: LoadedModel, num_tokens: int) -> None:
    """Warn when a context of ``num_tokens`` tokens (positions ``0 .. num_tokens - 1``) exceeds the model's
    ``max_position_embeddings`` (when the config has one): those positions were not trained.

    Called by every forward that grows or recomputes a context (:func:`forward_tokens`, the packed executors'
    traversals). Inside a call wrapped by :func:`one_context_warning` only the first such warning is issued.

    Warns:
        ContextLengthWarning: naming the context length and the limit.
    """
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or num_tokens <= limit:
        return
    scope = _WARN_SCOPE.get()
    if scope is not None:
        if scope[0]:
            return
        scope[0] = True
    warnings.warn(
        f"context of {num_tokens} tokens exceeds the model's max_position_embeddings={limit}; positions beyond "
        "it were not trained and results may be meaningless",
        ContextLengthWarning,
        stacklevel=user_stacklevel(),
    )


@torch.inference_mode()
def forward_tokens(
    lm: LoadedModel, ids: torch.Tensor, cache: DynamicCache, *, logits: str | int = "last"
) -> torch.Tensor | None:
    """Append ``ids`` to ``cache`` (in place), at positions ``N .. N + L - 1`` where N is the cache length.

    Args:
        lm: the model.
        ids: ``[L]`` int64 tokens, L >= 1.
        cache: the cache to extend (mutated: the caller owns it).
        logits: ``"last"`` (float32 ``[V]`` of the last position), ``"all"`` (float32 ``[L, V]``), ``"none"``, or an
            int k in [1, L] (float32 ``[k, V]`` of the last k positions).

    Returns:
        Logits as requested, on the model's device, float32.

    Warns:
        ContextLengthWarning: when ``N + L`` exceeds the model's ``max_position_embeddings``
            (:func:`check_context_length`).

    Raises:
        TypeError: if ``ids`` is not an integer tensor.
        ValueError: if ``ids`` is empty or not 1-D, holds an id outside ``[0, vocab_size)`` (checked before the
            embedding lookup), ``cache`` holds a batch of several sequences, or ``logits`` is not one of the three
            values.
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"ids must be a non-empty 1-D tensor (batch size 1); got shape {tuple(getattr(ids, 'shape', ()))}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"ids must be integer token ids; got dtype {ids.dtype}")
    check_vocab(ids, lm.spec.vocab_size, "ids")
    check_batch_one(cache, "cache")
    if isinstance(logits, bool) or not (
        logits in ("last", "all", "none") or (isinstance(logits, int) and 1 <= logits <= ids.numel())
    ):
        raise ValueError(f"logits={logits!r}; allowed: 'last', 'all', 'none' or an int in [1, {ids.numel()}]")
    start = cache_length(cache)
    check_context_length(lm, start + ids.numel())
    device = lm.device
    positions = torch.arange(start, start + ids.numel(), device=device)
    out = lm.model(
        input_ids=ids.to(device)[None],
        cache=cache,
        position_ids=positions[None],
        use_cache=True,
        logits_to_keep=logits if isinstance(logits, int) else (0 if logits == "all" else 1),
    )
    if logits == "none":
        return None
    result = out.logits[0].float()
    return result[-1] if logits == "last" else result


def prefill(lm: LoadedModel, ids: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """Build a cache for ``ids`` ``[N]`` from empty; returns ``(cache, last_logits [V] float32)``.

    Warns (:class:`ContextLengthWarning`, a ``UserWarning``) when N exceeds the model's ``max_position_embeddings``:
    positions past the trained range run, but the model was not trained there.

    Raises:
        ValueError, TypeError: see :func:`forward_tokens`.
    """
    cache = DynamicCache()
    return cache, forward_tokens(lm, ids, cache)


def decode_step(lm: LoadedModel, token: int, cache: DynamicCache) -> torch.Tensor:
    """Append one token to ``cache`` (in place); returns next-token logits ``[V]`` float32.

    Warns:
        ContextLengthWarning: as :func:`forward_tokens`.
    """
    return forward_tokens(lm, torch.tensor([token], dtype=torch.long), cache)


@torch.inference_mode()
def forward_batch(
    lm: LoadedModel,
    ids: torch.Tensor,
    cache: DynamicCache,
    positions: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    logits: str | int = "last",
) -> torch.Tensor | None:
    """Append ``ids`` ``[B, L]`` to a batch cache (in place), row b at positions ``positions[b]``.

    The cache holds B sequences ``[B, H_kv, N, d_h]`` per layer, shorter ones left-padded (:func:`sur_lab.cache_ops.
    stack_caches_`); ``attention_mask`` ``[B, N + L]`` (True: a real row) hides the padding, ``None`` when there is
    none. Causality is by cache row (the new tokens follow row N - 1 of every sequence); RoPE uses ``positions``, each
    row's own positions, so a padded row answers exactly as it would alone, up to the rounding of a batched forward.

    Args:
        lm: the model.
        ids: ``[B, L]`` int64 tokens, L >= 1.
        cache: the batch cache to extend (mutated: the caller owns it).
        positions: ``[B, L]`` int64 positions of the new tokens.
        attention_mask: ``[B, N + L]`` bool, or ``None`` (no padding).
        logits: ``"last"`` (float32 ``[B, V]``), ``"all"`` (float32 ``[B, L, V]``), ``"none"``, or an int k in
            [1, L] (float32 ``[B, k, V]`` of the last k positions).

    Returns:
        Logits as requested, on the model's device, float32.

    Warns:
        ContextLengthWarning: when a position reaches past the model's ``max_position_embeddings``
            (:func:`check_context_length`).

    Raises:
        ValueError: naming ``ids``, ``positions`` or ``attention_mask`` when their shapes disagree, an id outside
            ``[0, vocab_size)``, or ``logits`` not one of the allowed values.
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"ids must be a non-empty [B, L] tensor; got shape {tuple(getattr(ids, 'shape', ()))}")
    check_vocab(ids.reshape(-1), lm.spec.vocab_size, "ids")
    if tuple(positions.shape) != tuple(ids.shape):
        raise ValueError(f"positions has shape {tuple(positions.shape)}; ids has {tuple(ids.shape)}")
    n = cache_length(cache)
    if attention_mask is not None and tuple(attention_mask.shape) != (ids.shape[0], n + ids.shape[1]):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected "
                         f"({ids.shape[0]}, {n + ids.shape[1]}) (cache rows + new tokens)")
    length = ids.shape[1]
    if isinstance(logits, bool) or not (
        logits in ("last", "all", "none") or (isinstance(logits, int) and 1 <= logits <= length)
    ):
        raise ValueError(f"logits={logits!r}; allowed: 'last', 'all', 'none' or an int in [1, {length}]")
    if positions.numel():
        check_context_length(lm, int(positions.max()) + 1)
    device = lm.device
    out = lm.model(
        input_ids=ids.to(device),
        cache=cache,
        position_ids=positions.to(device),
        attention_mask=attention_mask.to(device) if attention_mask is not None else None,
        use_cache=True,
        logits_to_keep=logits if isinstance(logits, int) else (0 if logits == "all" else 1),
    )
    if logits == "none":
        return None
    result = out.logits.float()
    return result[:, -1] if logits == "last" else result
