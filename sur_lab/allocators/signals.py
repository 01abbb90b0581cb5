"""Forward-derived selection signals for the prior-work allocators (appendix 7.4, Table 1).

Two tools, both built on ordinary model forwards with PyTorch hooks (no change to the model):

- :func:`attention_probe` recomputes, inside each attention module's forward, the attention probabilities of *only the
  rows being forwarded* (query tokens, or a 64-token replay chunk) against the keys then in the cache:
  ``softmax(Q_rows K_cache^T / sqrt(d_h))`` with the causal mask, ``[H_Q, T, N_k]``. The queries are recomputed from the
  module's input (``q_proj``, the optional per-head ``q_norm`` of Qwen3 and GLM-4.5, RoPE with the model's own
  ``cos``/``sin`` over the rotary dimensions, partial for GLM-4.5) and
  the keys are read from the cache after the module has appended its rows, so no ``N × N`` matrix is ever formed and
  the model's fused attention path (SDPA) is untouched.
- :func:`forward_layers` runs a forward through only the first ``n`` decoder layers (a shallow prefill or query
  forward, as CacheBlend and A3 use) by stopping after layer ``n - 1``; the cache then holds ``n`` layers.

Threads: the hooks are registered on the shared model for the duration of the call, but each acts only on forwards
run in the context (thread, asyncio task) that registered it (:func:`_owned_hook`); forwards of other threads on the
same model meanwhile are neither stopped, probed nor recorded.

Shapes follow the house layout: caches ``[1, H_kv, N, d_h]``, probabilities ``[H_Q, T, N_k]`` with query head ``h``
reading KV head ``h // (H_Q / H_kv)`` (GQA).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache

from sur_lab.cache_ops import apply_rope, layer_kv
from sur_lab.forward import forward_tokens
from sur_lab.models import LoadedModel

#: ``fn(layer_index, probs)`` with ``probs`` ``[H_Q, T, N_k]`` float32 (float64 for float64 models).
RowCallback = Callable[[int, torch.Tensor], None]


def decoder_layers(lm: LoadedModel) -> torch.nn.ModuleList:
    """The model's decoder layers (``model.model.layers`` for every supported family)."""
    inner = getattr(lm.model, "model", lm.model)
    return inner.layers


#: Ids of the hook owners active in the current context (thread / task).
_OWNERS: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("sur_lab_hook_owners", default=frozenset())


@contextmanager
def _owned_hook() -> Iterator[Callable[[Callable], Callable]]:
    """Yield ``own(hook)``, which wraps a module hook so that it acts only on forwards of this context.

    A hook registered on a shared module fires for every thread's forwards; the wrapped one returns ``None`` (no
    effect) unless the forward runs in the context that entered this block, while the block is active.
    """
    key = object()
    token = _OWNERS.set(_OWNERS.get() | {id(key)})

    def own(hook: Callable) -> Callable:
        def guarded(*args, **kwargs):
            if id(key) in _OWNERS.get():
                return hook(*args, **kwargs)
            return None

        return guarded

    try:
        yield own
    finally:
        _OWNERS.reset(token)


class _StopForward(Exception):
    """Raised by a hook to end a forward after the layers a shallow signal needs."""


@torch.inference_mode()
def forward_layers(lm: LoadedModel, ids: torch.Tensor, cache: DynamicCache, num_layers: int | None = None) -> None:
    """Append ``ids`` ``[T]`` to ``cache`` (in place) through the first ``num_layers`` decoder layers only.

    The forward is stopped by an exception raised from a hook on layer ``num_layers - 1`` after that layer has written
    its K/V, so the cache holds exactly ``num_layers`` layers (all of them when ``num_layers`` is ``None``). Positions
    continue from the cache's current length, as in :func:`sur_lab.forward.forward_tokens`.

    Raises:
        ValueError: if ``num_layers`` is not in ``[1, L]``.
    """
    layers = decoder_layers(lm)
    if num_layers is None or num_layers == len(layers):
        forward_tokens(lm, ids, cache, logits="none")
        return
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers={num_layers} must be in [1, {len(layers)}]")

    def stop(module, args, output):  # noqa: ANN001 - torch hook signature
        raise _StopForward

    with _owned_hook() as own:
        handle = layers[num_layers - 1].register_forward_hook(own(stop))
        try:
            forward_tokens(lm, ids, cache, logits="none")
        except _StopForward:
            pass
        finally:
            handle.remove()


def _row_queries(attn: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Post-RoPE queries ``[1, H_Q, T, d_h]`` of the forwarded rows, as the attention module computes them."""
    head_dim = attn.head_dim
    q = attn.q_proj(hidden).view(*hidden.shape[:-1], -1, head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3 (and GLM-4.5 with use_qk_norm) normalize each query head before RoPE
        q = attn.q_norm(q)
    q = q.transpose(1, 2)
    # cos/sin span the rotary dimensions only: the whole head, or GLM-4.5's leading partial-rotary dimensions.
    return apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))


def row_attention(q: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention probabilities of the last ``T`` positions against all ``N_k`` keys.

    Args:
        q: ``[1, H_Q, T, d_h]`` post-RoPE queries of the rows at positions ``N_k - T .. N_k - 1``.
        keys: ``[1, H_kv, N_k, d_h]`` post-RoPE keys (the rows themselves included), H_Q a multiple of H_kv.
        scaling: softmax scale (``d_h ** -0.5``).

    Returns:
        ``[H_Q, T, N_k]`` probabilities in float32 (float64 if the inputs are float64); row t attends to keys
        ``0 .. N_k - T + t``.
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    h_q, t, d = q.shape[1], q.shape[2], q.shape[3]
    h_kv, n_k = keys.shape[1], keys.shape[2]
    group = h_q // h_kv
    qg = q[0].to(dtype).reshape(h_kv, group, t, d)
    logits = torch.matmul(qg, keys[0].to(dtype).transpose(-1, -2).unsqueeze(1)) * scaling  # (H_kv, g, T, N_k)
    first = n_k - t
    future = torch.arange(n_k, device=q.device)[None, :] > (first + torch.arange(t, device=q.device))[:, None]
    logits = logits.masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1).reshape(h_q, t, n_k)


@contextmanager
def attention_probe(
    lm: LoadedModel, cache: DynamicCache, on_rows: RowCallback, layers: Iterable[int] | None = None
) -> Iterator[None]:
    """Within the context, every forward that appends rows to ``cache`` reports their attention probabilities.

    After attention module ``l`` has run (so its cache layer holds the new rows' keys), ``on_rows(l, probs)`` receives
    ``probs`` ``[H_Q, T, N_k]`` from :func:`row_attention`, where T is the number of forwarded rows and N_k the cache
    length including them. Only these T rows are formed, never the ``N_k × N_k`` matrix.

    Args:
        lm: the model.
        cache: the cache the forwards inside the context append to.
        on_rows: callback, called once per probed layer per forward.
        layers: layer indices to probe (all when ``None``).
    """
    wanted = set(range(len(decoder_layers(lm)))) if layers is None else set(layers)
    handles = []

    def make_hook(index: int):
        def hook(module, args, kwargs, output):  # noqa: ANN001 - torch hook signature
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            q = _row_queries(module, hidden, cos, sin)
            keys, _ = layer_kv(cache, index)
            on_rows(index, row_attention(q, keys, module.scaling))

        return hook

    with _owned_hook() as own:
        for index, layer in enumerate(decoder_layers(lm)):
            if index in wanted:
                handles.append(layer.self_attn.register_forward_hook(own(make_hook(index)), with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


@contextmanager
def capture_residual_norms(lm: LoadedModel, layers: Iterable[int], store: dict[int, torch.Tensor]) -> Iterator[None]:
    """Within the context, store the L2 norm of each listed decoder layer's output hidden state per token.

    ``store[l]`` becomes float32 ``[T]`` (CPU): ``||h_{l,t}||_2`` of the residual stream after layer ``l`` (before the
    final norm), computed in float32 inside the hook so that no ``[T, hidden]`` activations are kept. A later forward
    through the same layer overwrites its entry.
    """
    handles = []
    modules = decoder_layers(lm)

    def make_hook(index: int):
        def hook(module, args, output):  # noqa: ANN001 - torch hook signature
            hidden = output[0] if isinstance(output, tuple) else output
            store[index] = hidden[0].float().norm(dim=-1).cpu()

        return hook

    with _owned_hook() as own:
        for index in layers:
            handles.append(modules[index].register_forward_hook(own(make_hook(index))))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
