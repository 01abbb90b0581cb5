"""KV-cache operations: the only module that touches transformers' cache internals.

A cache is a transformers ``DynamicCache`` (v5: ``cache.layers[i].keys`` / ``.values``), each layer holding keys and
values shaped ``(batch=1, num_kv_heads, seq_len, head_dim)``. Keys are cached *after* RoPE, so any function that moves
tokens to other positions says whether it re-rotates keys. Every function here returns a new cache and leaves its
input untouched, except the ones named ``*_`` (trailing underscore), which write into a cache the caller owns.

Source: appendix 7.1 (Shift, Eq. 2; sparse refresh writes), appendix 13.2 (indexed writes, Eq. 21).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

KV = tuple[torch.Tensor, torch.Tensor]


def from_tensors(layers: Sequence[KV]) -> DynamicCache:
    """Build a ``DynamicCache`` holding the given per-layer ``(keys, values)`` (no copy is made).

    Args:
        layers: one ``(K, V)`` pair per layer, each ``[1, H_kv, N, d_h]``.
    """
    layers = list(layers)
    # DynamicCache(ddp_cache_data=...) initialises each layer by concatenating onto an empty tensor, i.e. a full copy;
    # initialise with zero-row views instead, then hand the layers the given tensors themselves.
    cache = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in layers])
    for layer, (k, v) in zip(cache.layers, layers):
        layer.keys, layer.values = k, v
    return cache


def held_kv(cache, name: str = "cache") -> list[KV]:
    """Per-layer ``(K, V)`` ``[B, H_kv, n, d_h]`` of the rows a transformers cache actually holds.

    A ``DynamicCache`` (full-attention ``DynamicLayer`` layers) gives its tensors as they are (views, no copy). A
    ``StaticCache`` gives only its filled rows ``[0, get_seq_length())``, never the zero padding it preallocates, and
    gives them as copies: a StaticCache writes into its buffers in place when the caller keeps using it, which would
    change views held elsewhere. Every layer must be initialized and hold the same number of rows.

    Args:
        cache: the cache; anything else is refused by type.
        name: the argument's name, for the errors.

    Returns:
        One ``(keys, values)`` pair per layer.

    Raises:
        TypeError: naming ``name`` for ``None``, a legacy tuple / list of per-layer tuples (wrap it with
            ``DynamicCache(ddp_cache_data=...)``), any object that is not a transformers ``DynamicCache`` or
            ``StaticCache`` (``QuantizedCache``, ``EncoderDecoderCache``, ...), or layers that are sliding-window,
            quantized or of another kind (named).
        ValueError: naming ``name`` when a layer is not initialized or the layers hold different numbers of rows.
    """
    if cache is None:
        raise TypeError(f"{name} is None; pass the transformers DynamicCache (or StaticCache) of the context")
    if isinstance(cache, (tuple, list)):
        raise TypeError(
            f"{name} is a legacy {type(cache).__name__} cache; wrap it as "
            "transformers.DynamicCache(ddp_cache_data=[(keys, values), ...]) (one pair per layer)"
        )
    static = isinstance(cache, StaticCache)
    if not isinstance(cache, DynamicCache) and not static:
        raise TypeError(
            f"{name} is a {type(cache).__name__}; accepted: transformers DynamicCache (full attention) or "
            "StaticCache (its filled rows are taken)"
        )
    layers = []
    for i, entry in enumerate(cache.layers):
        kind = type(entry)
        allowed = StaticLayer if static else DynamicLayer
        if kind is not allowed or getattr(entry, "is_sliding", False):
            raise TypeError(
                f"{name} layer {i} is a {kind.__name__}; repair needs full-attention {allowed.__name__} layers"
            )
        if not getattr(entry, "is_initialized", False) or entry.keys is None:
            raise ValueError(f"{name} layer {i} holds no keys (not initialized): prefill the context into it first")
        if static:
            filled = int(entry.get_seq_length())
            layers.append((entry.keys[:, :, :filled].clone(), entry.values[:, :, :filled].clone()))
        else:
            layers.append((entry.keys, entry.values))
    rows = sorted({int(k.shape[-2]) for k, _ in layers} | {int(v.shape[-2]) for _, v in layers})
    if len(rows) > 1:
        raise ValueError(f"{name} layers hold different numbers of rows ({rows}); every layer must hold the same rows")
    return layers


def check_model_kv(
    layers: Sequence[KV], *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device | str | None = None, name: str = "cache",
) -> int:
    """Check per-layer ``(K, V)`` (from :func:`held_kv`) against a model; returns the rows held, n.

    Raises:
        ValueError: naming ``name`` and the model's value when the layer count, the batch size (must be 1), the
            number of KV heads, the head dim of keys or values, the dtype or the device differs from the model's.
    """
    if len(layers) != num_layers:
        raise ValueError(f"{name} has {len(layers)} layers; the model has {num_layers}")
    for i, (k, v) in enumerate(layers):
        for what, t in (("keys", k), ("values", v)):
            if t.dim() != 4:
                raise ValueError(f"{name} layer {i} {what} are {t.dim()}-D; need [1, H_kv, n, d_h]")
            b, h, _, d = t.shape
            if b != 1:
                raise ValueError(f"{name} holds a batch of {b} sequences; repair needs batch size 1")
            if h != num_kv_heads:
                raise ValueError(f"{name} layer {i} {what} have {h} KV heads; the model has {num_kv_heads}")
            if d != head_dim:
                raise ValueError(f"{name} layer {i} {what} have head dim {d}; the model's head_dim is {head_dim}")
            if t.dtype != dtype:
                raise ValueError(f"{name} layer {i} {what} are {t.dtype}; the model runs in {dtype}")
            if device is not None and t.device != torch.device(device):
                raise ValueError(f"{name} layer {i} {what} are on {t.device}; the model is on {device}")
    return int(layers[0][0].shape[-2]) if layers else 0


def layer_kv(cache: DynamicCache, layer: int) -> KV:
    """Return layer ``layer``'s ``(keys, values)``, each ``[1, H_kv, N, d_h]`` (views, not copies)."""
    entry = cache.layers[layer]
    return entry.keys, entry.values


def num_layers(cache: DynamicCache) -> int:
    """Number of layers held by the cache."""
    return len(cache.layers)


def cache_length(cache: DynamicCache) -> int:
    """Cached sequence length N (tokens)."""
    return cache.get_seq_length()


def to_tensors(cache: DynamicCache) -> list[KV]:
    """Per-layer ``(K, V)`` views of the cache."""
    return [layer_kv(cache, i) for i in range(num_layers(cache))]


def clone_cache(cache: DynamicCache) -> DynamicCache:
    """Deep copy: new tensors, same values (bitwise)."""
    return from_tensors([(k.clone(), v.clone()) for k, v in to_tensors(cache)])


def slice_rows(cache: DynamicCache, start: int, end: int) -> DynamicCache:
    """Copy of rows ``[start, end)`` of every layer, without re-rotation (positions are not changed).

    Raises:
        ValueError: if ``0 <= start <= end <= N`` does not hold.
    """
    n = cache_length(cache)
    if not 0 <= start <= end <= n:
        raise ValueError(f"rows [start={start}, end={end}) must satisfy 0 <= start <= end <= {n}")
    return from_tensors([(k[:, :, start:end].clone(), v[:, :, start:end].clone()) for k, v in to_tensors(cache)])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotate-half pairing used by Llama/Qwen RoPE: ``(x1, x2) -> (-x2, x1)`` over the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the leading ``rotary_dim = cos.shape[-1]`` dimensions of ``x``; the rest pass through.

    This is the layout of every supported family: the whole head for Llama, Mistral, Qwen2/3 and their MoE variants
    (``rotary_dim = d_h``), the leading dimensions for GLM-4.5's partial rotary (``q[..., :rotary_dim]`` in
    transformers' ``modeling_glm4_moe.py``). Arithmetic happens in the promoted dtype of ``x``, ``cos`` and ``sin``.

    Args:
        x: ``[..., d_h]``.
        cos, sin: broadcastable to ``[..., rotary_dim]`` with ``rotary_dim`` even and ``<= d_h``.

    Returns:
        New tensor ``[..., d_h]`` in the promoted dtype; pass-through dimensions are copied bitwise.
    """
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot = x[..., :width]
    rotated = rot * cos + rotate_half(rot) * sin
    return torch.cat((rotated, x[..., width:].to(rotated.dtype)), dim=-1)


def _check_inv_freq(keys: torch.Tensor, inv_freq: torch.Tensor) -> None:
    head_dim = keys.shape[-1]
    if inv_freq.dim() != 1 or not 1 <= inv_freq.numel() <= head_dim // 2:
        raise ValueError(
            f"inv_freq has shape {tuple(inv_freq.shape)}; keys need 1-D inverse frequencies with 1 to "
            f"head_dim // 2 = {head_dim // 2} entries"
        )


def _rotate_leading(keys: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """The one re-rotation of post-RoPE keys: ``R_angles`` on the leading ``rotary_dim = 2 * angles.shape[-1]``
    dimensions of each head (rotate-half pairing), the rest copied bitwise.

    ``angles`` are float64 ``[rotary_dim // 2]`` (one offset for every row) or ``[L, rotary_dim // 2]`` (one per
    row). cos and sin are formed in float64, the rotation runs in float32 (float64 for float64 keys) and the result
    is cast to the key dtype once, so bf16 / fp16 keys carry one rounding (appendix 7.1). Both public forms,
    :func:`rerotate_keys` and :func:`rerotate_rows`, go through here: a row gets bitwise the same result from either.
    """
    compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(compute), emb.sin().to(compute)
    width = emb.shape[-1]
    rotated = apply_rope(keys[..., :width].to(compute), cos, sin).to(keys.dtype)  # one rounding to the key dtype
    if width == keys.shape[-1]:
        return rotated
    return torch.cat((rotated, keys[..., width:]), dim=-1)


def rerotate_keys(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move post-RoPE keys by ``delta`` positions: ``K' = R_delta K`` (Eq. 2 with ``delta = -d``).

    Because rotate-half RoPE composes additively, ``R_{i-d} R_i^{-1} = R_{-d}`` for every position i, so one rotation
    serves the whole suffix. Only the leading ``rotary_dim = 2 * len(inv_freq)`` dimensions of each head are rotated
    (the whole head except for partial rotary, GLM-4.5); the rest are copied bitwise. Angles are formed in float64
    from the model's inverse frequencies; the rotation is computed in float32 (float64 for float64 keys), so bf16 and
    fp16 keys are rounded once, at the end (appendix 7.1). RoPE variants that scale cos and sin by a constant (YaRN's
    attention factor) are handled exactly since the factor cancels in the relative rotation. Same arithmetic as
    :func:`rerotate_rows` (one shared helper).

    Args:
        keys: ``[1, H_kv, L, d_h]`` post-RoPE keys, any float dtype.
        delta: signed position offset in tokens.
        inv_freq: ``[rotary_dim // 2]`` inverse frequencies, ``rotary_dim <= d_h`` (any float dtype; promoted to
            float64).

    Returns:
        New tensor, same shape and dtype as ``keys``.

    Raises:
        ValueError: if ``inv_freq`` is not 1-D with between 1 and ``d_h // 2`` entries.
    """
    _check_inv_freq(keys, inv_freq)
    angles = float(delta) * inv_freq.detach().to(device=keys.device, dtype=torch.float64)
    return _rotate_leading(keys, angles)


def rerotate_rows(keys: torch.Tensor, deltas: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move each post-RoPE key row by its own offset: ``K'[..., j, :] = R_{deltas[j]} K[..., j, :]`` (Eq. 2 per row).

    Used to re-rotate keys from the position they were computed at (their recorded angle) straight to their current
    position, so that a row moved by many successive edits is rotated once, not once per edit. As in
    :func:`rerotate_keys` (the same helper): only the leading ``rotary_dim = 2 * len(inv_freq)`` dimensions are
    rotated (partial rotary, GLM-4.5: the rest are copied bitwise); angles are formed in float64; the rotation
    arithmetic runs in float32 (float64 for float64 keys) and the result is cast to the key dtype once, so bfloat16 /
    float16 keys carry a single rounding (appendix 7.1). A zero offset returns the row bitwise (cos 0 = 1, sin 0 = 0).

    Args:
        keys: ``[1, H_kv, L, d_h]`` post-RoPE keys, any float dtype.
        deltas: ``[L]`` integer offsets in tokens (signed), one per row.
        inv_freq: ``[rotary_dim // 2]`` inverse frequencies, ``rotary_dim <= d_h`` (any float dtype; promoted to
            float64).

    Returns:
        New tensor, same shape and dtype as ``keys``.

    Raises:
        ValueError: if ``inv_freq`` is not 1-D with between 1 and ``d_h // 2`` entries or ``deltas`` does not have
            one entry per row.
    """
    _check_inv_freq(keys, inv_freq)
    rows = keys.shape[-2]
    deltas = torch.as_tensor(deltas).reshape(-1)
    if deltas.numel() != rows:
        raise ValueError(f"deltas has {deltas.numel()} entries; keys have {rows} rows")
    # [L, rotary_dim / 2] angles in float64: positions reach 1e5+ and float32 products would lose the low bits.
    angles = deltas.to(device=keys.device, dtype=torch.float64)[:, None] * inv_freq.detach().to(
        device=keys.device, dtype=torch.float64
    )[None]
    return _rotate_leading(keys, angles)


def _check_shift_args(cache: DynamicCache, prefix_len: int, deleted_len: int) -> int:
    """Check a Shift's span against the cache; return the cache length N (tokens). Raises ValueError naming both."""
    n = cache_length(cache)
    if prefix_len < 0 or deleted_len < 1 or prefix_len + deleted_len > n:
        raise ValueError(
            f"need 0 <= prefix_len ({prefix_len}) and 1 <= deleted_len ({deleted_len}) with "
            f"prefix_len + deleted_len <= cache length {n}"
        )
    return n


def shift_cache(cache: DynamicCache, prefix_len: int, deleted_len: int, inv_freq: torch.Tensor) -> DynamicCache:
    """Shift: drop rows ``[p, p + d)`` and re-rotate the suffix keys by ``-d`` positions; values are unchanged.

    No contextual forward is run, so the suffix still carries the deleted span's influence (appendix 7.1).

    Args:
        cache: Dirty cache of ``p ⊕ e ⊕ s``, ``N = p + d + S`` rows; not modified.
        prefix_len: p, tokens.
        deleted_len: d >= 1, tokens.
        inv_freq: the model's RoPE inverse frequencies ``[rotary_dim // 2]`` (:func:`rerotate_keys`).

    Returns:
        New cache of ``p + S`` rows: prefix rows bitwise copies, suffix keys re-rotated (their rotary dimensions;
        pass-through dimensions of partial rotary copied), suffix values copied.

    Raises:
        ValueError: if ``prefix_len < 0``, ``deleted_len < 1`` or ``prefix_len + deleted_len > N``.
    """
    _check_shift_args(cache, prefix_len, deleted_len)
    end = prefix_len + deleted_len
    layers = []
    for k, v in to_tensors(cache):
        suffix_k = rerotate_keys(k[:, :, end:], -deleted_len, inv_freq)
        layers.append(
            (
                torch.cat((k[:, :, :prefix_len], suffix_k), dim=2),
                torch.cat((v[:, :, :prefix_len], v[:, :, end:]), dim=2),
            )
        )
    return from_tensors(layers)


def shift_cache_(cache: DynamicCache, prefix_len: int, deleted_len: int, inv_freq: torch.Tensor) -> DynamicCache:
    """In-place Shift of a cache the caller gives up: drop rows ``[p, p + d)`` and re-rotate the moved suffix keys.

    Same result as :func:`shift_cache`, bitwise (the keys go through the same :func:`rerotate_keys` call on the same
    rows), but no second cache is allocated: per layer, the suffix keys are re-rotated by ``-d`` into one temporary
    and written back at ``[p, p + S)``; the suffix values are moved there through one temporary too (source and
    destination overlap, which ``copy_`` refuses). The layers then hold views of rows ``[0, p + S)`` of the original
    storage (the ``d`` trailing rows stay allocated and unused).

    The input is consumed: ``cache`` itself is modified and returned; its old rows are gone.

    Args:
        cache: Dirty cache of ``p ⊕ e ⊕ s``, ``N = p + d + S`` rows, ``[1, H_kv, N, d_h]`` per layer; consumed.
        prefix_len: p, tokens.
        deleted_len: d >= 1, tokens.
        inv_freq: the model's RoPE inverse frequencies ``[rotary_dim // 2]`` (:func:`rerotate_keys`).

    Returns:
        ``cache`` (the same object) holding ``p + S`` rows.

    Raises:
        ValueError: as :func:`shift_cache`, before anything is modified.

    Source: appendix 7.1 (Shift, Eq. 2); issue 17 (in-place form for owned caches).
    """
    n = _check_shift_args(cache, prefix_len, deleted_len)
    end = prefix_len + deleted_len
    kept = n - deleted_len
    for entry in cache.layers:
        k, v = entry.keys, entry.values
        moved = rerotate_keys(k[:, :, end:], -deleted_len, inv_freq)  # the key temporary (rotation output)
        k[:, :, prefix_len:kept].copy_(moved)
        del moved
        v[:, :, prefix_len:kept].copy_(v[:, :, end:].clone())
        entry.keys, entry.values = k[:, :, :kept], v[:, :, :kept]
    return cache


def write_rows_(cache: DynamicCache, start: int, rows: Sequence[KV]) -> None:
    """In place: overwrite rows ``[start, start + L)`` of every layer with ``rows[layer] = (K, V)`` ``[1,H_kv,L,d_h]``.

    The cache length does not change (appendix 7.1, sparse refresh writes).

    Raises:
        ValueError: on a layer-count mismatch or rows that would run past the cache end.
    """
    if len(rows) != num_layers(cache):
        raise ValueError(f"rows has {len(rows)} layers; cache has {num_layers(cache)}")
    n = cache_length(cache)
    for layer, (k_new, v_new) in enumerate(rows):
        length = k_new.shape[2]
        if start < 0 or start + length > n:
            raise ValueError(f"rows [start={start}, {start + length}) run past the cache length {n}")
        k, v = layer_kv(cache, layer)
        k[:, :, start : start + length] = k_new
        v[:, :, start : start + length] = v_new


def scatter_rows_(cache: DynamicCache, layer: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
    """In place: write ``keys``/``values`` ``[1, H_kv, B, d_h]`` at row indices ``positions`` ``[B]`` of one layer.

    Eq. 21, appendix 13.2 (indexed write of fresh K/V before attention).
    """
    k, v = layer_kv(cache, layer)
    k.index_copy_(2, positions, keys.to(k.dtype))
    v.index_copy_(2, positions, values.to(v.dtype))


def stack_caches_(caches: list[DynamicCache]) -> tuple[DynamicCache, list[int]]:
    """Stack batch-1 caches of any lengths into one batch cache, left-padded with zero rows; consumes the inputs.

    Row i of the result holds cache i's rows at the end of the sequence axis, after ``Lmax - L_i`` zero rows (no
    re-rotation: each row keeps the positions its keys were rotated for; the caller masks the padding and passes each
    row's own positions). Built layer by layer, and each input layer is released once copied, so peak memory is about
    one stacked copy plus one layer. Every cache of ``caches`` is emptied (its layers set to zero rows) and the list is
    cleared: the caller gives them up.

    Args:
        caches: B >= 1 caches, each ``[1, H_kv, L_i, d_h]`` per layer, same layer count, heads, head dim, dtype and
            device.

    Returns:
        ``(stacked, pads)``: a cache ``[B, H_kv, Lmax, d_h]`` per layer and the zero rows ``Lmax - L_i`` before row i.

    Raises:
        ValueError: naming ``caches`` when it is empty, a cache is not batch 1, or the layouts differ (nothing is
            consumed then).
    """
    if not caches:
        raise ValueError("caches is empty; stack at least one cache")
    first = to_tensors(caches[0])
    lengths = []
    for i, c in enumerate(caches):
        kv = to_tensors(c)
        if len(kv) != len(first):
            raise ValueError(f"caches[{i}] has {len(kv)} layers; caches[0] has {len(first)}")
        k0, k = first[0][0], kv[0][0]
        if k.shape[0] != 1 or k.shape[1] != k0.shape[1] or k.shape[3] != k0.shape[3] or k.dtype != k0.dtype:
            raise ValueError(f"caches[{i}] has keys {tuple(k.shape)} {k.dtype}; caches[0] has {tuple(k0.shape)} "
                             f"{k0.dtype} (stacking needs batch 1 and the same heads, head dim and dtype)")
        lengths.append(k.shape[2])
    longest = max(lengths)
    pads = [longest - n for n in lengths]
    layers = []
    for layer in range(len(first)):
        ks, vs = [], []
        for c, pad in zip(caches, pads):
            k, v = layer_kv(c, layer)
            if pad:
                k = torch.cat((k.new_zeros(1, k.shape[1], pad, k.shape[3]), k), dim=2)
                v = torch.cat((v.new_zeros(1, v.shape[1], pad, v.shape[3]), v), dim=2)
            ks.append(k)
            vs.append(v)
        layers.append((torch.cat(ks, dim=0), torch.cat(vs, dim=0)))
        for c in caches:  # release this layer of every input before the next one is copied
            entry = c.layers[layer]
            entry.keys, entry.values = entry.keys[:, :, :0], entry.values[:, :, :0]
    caches.clear()
    return from_tensors(layers), pads


def crop_(cache: DynamicCache, length: int) -> None:
    """In place: keep the first ``length`` rows of every layer (rows appended after them are dropped).

    Raises:
        ValueError: if ``length`` is outside ``[0, N]``.
    """
    n = cache_length(cache)
    if not 0 <= length <= n:
        raise ValueError(f"length={length} must lie in [0, {n}]")
    for entry in cache.layers:
        entry.keys, entry.values = entry.keys[:, :, :length], entry.values[:, :, :length]


def caches_equal(a: DynamicCache, b: DynamicCache) -> bool:
    """True when both caches have the same shapes, dtypes and bitwise-identical keys and values."""
    if num_layers(a) != num_layers(b):
        return False
    for (ka, va), (kb, vb) in zip(to_tensors(a), to_tensors(b)):
        if ka.shape != kb.shape or ka.dtype != kb.dtype or not (torch.equal(ka, kb) and torch.equal(va, vb)):
            return False
    return True


def max_abs_diff(a: DynamicCache, b: DynamicCache, rows: slice | None = None) -> tuple[float, float]:
    """Largest absolute key and value differences over all layers (optionally restricted to ``rows``)."""
    rows = rows or slice(None)
    dk = dv = 0.0
    for (ka, va), (kb, vb) in zip(to_tensors(a), to_tensors(b)):
        dk = max(dk, (ka[:, :, rows].double() - kb[:, :, rows].double()).abs().max().item())
        dv = max(dv, (va[:, :, rows].double() - vb[:, :, rows].double()).abs().max().item())
    return dk, dv


def layer_deviation(a: DynamicCache, b: DynamicCache, rows: slice | None = None) -> torch.Tensor:
    """Per-layer, per-position L2 deviation ``||K_a - K_b||² + ||V_a - V_b||²`` summed over heads, ``[L, n]`` float64."""
    rows = rows or slice(None)
    out = []
    for (ka, va), (kb, vb) in zip(to_tensors(a), to_tensors(b)):
        dk = (ka[0, :, rows].double() - kb[0, :, rows].double()).pow(2).sum(dim=(0, 2))
        dv = (va[0, :, rows].double() - vb[0, :, rows].double()).pow(2).sum(dim=(0, 2))
        out.append(dk + dv)
    return torch.stack(out)
