"""Pure-PyTorch references for indexed (packed) attention and indexed K/V writes.

Packed attention evaluates B selected query rows at sorted absolute positions U = (u_1 < ... < u_B) against a KV cache
of N positions: O_r = softmax(q_r K_{0:u_r}^T * scale) V_{0:u_r}, keys 0..u_r inclusive (Eq. 22, appendix 13.2). The
write step puts fresh K/V rows at the selected positions before attention (Eq. 21).

Layout is transformers' ``(batch=1, heads, seq_len, head_dim)``: q ``[1, Hq, B, D]``, k and v ``[1, Hkv, N, D]``. Query
head h reads KV head ``h // (Hq // Hkv)``, the mapping of transformers' ``repeat_kv``. Nothing here moves a token, so
no key is re-rotated: K rows are written and read at their own positions, after RoPE.

Three references, each with a different job:
    * ``causal_attention_oracle``: float64 throughout with an explicit boolean mask; the ground truth of the kernel
      tests (appendix 13.5). It materializes a B x N mask: fine for tests, never for production.
    * ``packed_sdpa_reference``: torch SDPA in the input dtype; the same-dtype PyTorch reference whose own error
      calibrates tolerances, and the fallback of ``indexed_attention`` where Triton does not run.
    * ``indexed_scatter_kv_reference``: ``index_copy_`` writes, the default write path (Torch writes were faster in
      the paper's measured complete-refresh path).

This module imports no Triton, so it works on every install; ``sur_lab.executors.kernels.indexed_attention`` reuses its checks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "as_positions",
    "causal_attention_oracle",
    "kernel_error_floor",
    "packed_sdpa_reference",
    "indexed_scatter_kv_reference",
]


def as_positions(positions: torch.Tensor | Sequence[int], name: str = "positions") -> torch.Tensor:
    """Validate selected positions and return them as a 1-D int64 tensor on their own device.

    Args:
        positions: ``[B]`` absolute zero-based cache positions (tokens), any integer dtype or a sequence of ints;
            must be strictly increasing (sorted, unique) and non-negative. B = 0 is allowed.
        name: the argument name used in error messages.

    Returns:
        ``[B]`` contiguous int64 tensor (a new tensor only when a conversion was needed).

    Raises:
        ValueError: naming ``name`` if positions are not 1-D, not integers, negative, unsorted or duplicated.

    Checking order needs the values on the host, so a CUDA tensor costs one synchronization here; callers build a
    plan once per refresh and reuse it across layers (appendix 13.2, "Reusable execution plan").
    """
    if not isinstance(positions, torch.Tensor):
        try:
            positions = torch.as_tensor(positions)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{name} must be a 1-D sequence of ints, got {positions!r}") from exc
        if positions.numel() == 0:
            # torch.as_tensor([]) is float32; an empty selection is still a valid (empty) set of positions.
            positions = positions.to(torch.int64)
    if positions.dtype == torch.bool or positions.is_floating_point() or positions.is_complex():
        raise ValueError(f"{name} must have an integer dtype, got {positions.dtype}")
    if positions.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B], got shape {tuple(positions.shape)}")
    positions = positions.to(torch.int64).contiguous()  # kernels read positions with unit stride
    if positions.numel() > 0:
        if int(positions.min()) < 0:
            raise ValueError(f"{name} must be non-negative, got min {int(positions.min())}")
        if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
            raise ValueError(f"{name} must be sorted and strictly increasing (no duplicates), got {positions.tolist()}")
    return positions


def check_attention_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_rows: int, max_position: int
) -> tuple[int, int, int, int, int]:
    """Check packed-attention shapes and return ``(Hq, Hkv, B, N, D)``.

    Raises:
        ValueError: naming ``q``, ``k``, ``v`` or ``positions`` when ranks, batch, head counts (Hq % Hkv), head dims,
            row counts, dtypes or devices disagree, or when ``max_position >= N``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [1, heads, seq, head_dim], got shape {tuple(t.shape)}")
        if t.shape[0] != 1:
            raise ValueError(f"{name} must have batch size 1, got shape {tuple(t.shape)}")
    _, hq, b, d = q.shape
    _, hkv, n, dk = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if dk != d:
        raise ValueError(f"k head_dim {dk} must equal q head_dim {d}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k heads ({hkv}) for grouped-query attention")
    if b != num_rows:
        raise ValueError(f"q has {b} rows (dim 2) but positions has {num_rows}")
    if max_position >= n:
        raise ValueError(f"positions must be < N = {n} (k/v seq_len), got max {max_position}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must share a device, got q {q.device}, k {k.device}, v {v.device}")
    return hq, hkv, b, n, d


def check_scatter_shapes(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    num_rows: int,
    max_position: int,
) -> tuple[int, int, int, int]:
    """Check indexed-write shapes and return ``(Hkv, B, N, D)``.

    Raises:
        ValueError: naming ``k_cache``, ``v_cache``, ``k_new``, ``v_new`` or ``positions`` when shapes, dtypes or
            devices disagree, or when ``max_position >= N``.
    """
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4 or t.shape[0] != 1:
            raise ValueError(f"{name} must be 4-D [1, num_kv_heads, seq, head_dim], got shape {tuple(t.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    _, hkv, n, d = k_cache.shape
    expected = (1, hkv, num_rows, d)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} (B = len(positions)), got {tuple(t.shape)}")
    if max_position >= n:
        raise ValueError(f"positions must be < N = {n} (cache seq_len), got max {max_position}")
    for name, t in (("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} must equal k_cache dtype {k_cache.dtype}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} device {t.device} must equal k_cache device {k_cache.device}")
    return hkv, num_rows, n, d


def _causal_mask(positions: torch.Tensor, n: int) -> torch.Tensor:
    # [B, N] boolean, True where key j is visible to packed row r: j <= u_r (Eq. 22). Tests and references only.
    return torch.arange(n, device=positions.device)[None, :] <= positions[:, None]


def causal_attention_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor | Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Packed causal attention computed in float64 with an explicit mask: the ground truth for kernel tests.

    Args:
        q: ``[1, Hq, B, D]`` queries of the selected rows (any floating dtype; upcast to float64).
        k: ``[1, Hkv, N, D]`` keys of the whole cache (after RoPE), Hq a multiple of Hkv.
        v: ``[1, Hkv, N, D]`` values.
        positions: ``[B]`` sorted, unique absolute positions U of the rows of q.
        scale: softmax scale; defaults to ``1 / sqrt(D)``.

    Returns:
        ``[1, Hq, B, D]`` float64: ``O_r = softmax(q_r K_{0:u_r}^T * scale) V_{0:u_r}``, keys 0..u_r inclusive.

    Raises:
        ValueError: as ``check_attention_shapes`` and ``as_positions``.

    Source: Eq. 22, appendix 13.2; the FP64 oracle of appendix 13.5.
    """
    scores, visible, v64 = _scores64(q, k, v, positions, scale)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v64)  # (1, Hq, B, D)


def _scores64(q, k, v, positions, scale):
    """Validated float64 ``(scores [1, Hq, B, N], visible [B, N], values [1, Hq, N, D])`` with the repeat_kv head
    mapping (query head h reads KV head h // (Hq // Hkv)); scores are scaled, not masked."""
    pos = as_positions(positions)
    hq, hkv, _, n, d = check_attention_shapes(q, k, v, pos.numel(), int(pos.max()) if pos.numel() else -1)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kv_head = torch.arange(hq, device=q.device) // (hq // hkv)
    k64, v64 = k.to(torch.float64)[:, kv_head], v.to(torch.float64)[:, kv_head]  # (1, Hq, N, D)
    scores = torch.matmul(q.to(torch.float64), k64.transpose(-1, -2)) * scale  # (1, Hq, B, N)
    return scores, _causal_mask(pos.to(q.device), n), v64


def kernel_error_floor(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor | Sequence[int],
    scale: float | None = None,
    *,
    oracle: torch.Tensor | None = None,
) -> float:
    """Error floor of the kernel check ``max|out - oracle| <= 2 * max|sdpa - oracle| + floor`` (absolute units).

    Two terms: one ulp of the output dtype at the largest ``|oracle|`` (rounding the exact result costs half of that
    alone), and the FP32 budget of an exp2-based online softmax (FlashAttention's formulation, which the kernel
    uses for every input dtype): forming ``exp2((s_j - m) * log2 e)`` rounds the argument, a relative error of up to
    ``|s_j - m| * log2(e) * eps`` in ``p_j`` (plus ``eps`` for exp2 and one for the normalisation), so the output can
    be off by ``eps32 * max|v| * (2 + log2(e) * max_r (max_j s_rj - min_j s_rj))`` over visible scores even with
    exact dot products. SDPA's CPU kernel exponentiates directly and can be far more accurate on a given input, so
    twice its error alone is not a bound (measured: 3.1e-7 vs 1.1e-7 on a 2-row FP32 case).

    Args:
        q, k, v, positions, scale: as :func:`causal_attention_oracle`.
        oracle: that function's output for these inputs when the caller already has it (it is not recomputed).

    Returns:
        The floor, a Python float (0.0 when there are no rows).

    Raises:
        ValueError: as :func:`causal_attention_oracle`.
    """
    scores, visible, v64 = _scores64(q, k, v, positions, scale)
    if visible.shape[0] == 0:
        return 0.0
    spread = scores.masked_fill(~visible, -math.inf).amax(-1) - scores.masked_fill(~visible, math.inf).amin(-1)
    if oracle is None:
        oracle = torch.matmul(torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1), v64)
    oracle_max = oracle.abs().max().item()
    ulp = torch.finfo(q.dtype).eps * oracle_max
    eps32 = torch.finfo(torch.float32).eps
    return ulp + eps32 * v64.abs().max().item() * (2 + math.log2(math.e) * spread.max().item())


def packed_sdpa_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor | Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Packed causal attention with torch SDPA in the input dtype: the same-dtype PyTorch reference.

    Args:
        q: ``[1, Hq, B, D]`` queries; k, v: ``[1, Hkv, N, D]``; same floating dtype and device.
        positions: ``[B]`` sorted, unique absolute positions U of the rows of q.
        scale: softmax scale; defaults to ``1 / sqrt(D)``.

    Returns:
        ``[1, Hq, B, D]`` in q's dtype.

    Raises:
        ValueError: as ``check_attention_shapes`` and ``as_positions``.

    Builds a ``[B, N]`` boolean mask per call (what the paper's packed-SDPA backend does) and lets SDPA map GQA heads
    with ``enable_gqa=True`` (torch >= 2.5), which matches ``repeat_kv``. Source: Eq. 22, appendix 13.2.
    """
    pos = as_positions(positions)
    _, _, _, n, d = check_attention_shapes(q, k, v, pos.numel(), int(pos.max()) if pos.numel() else -1)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    mask = _causal_mask(pos.to(q.device), n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


@torch.no_grad()
def indexed_scatter_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    positions: torch.Tensor | Sequence[int],
) -> None:
    """Write fresh K/V rows into the caches at the selected positions with ``index_copy_``. MUTATES the caches.

    Args:
        k_cache, v_cache: ``[1, Hkv, N, D]`` layer caches, written in place (keys stay as given: no re-rotation).
        k_new, v_new: ``[1, Hkv, B, D]`` fresh rows, same dtype and device as the caches.
        positions: ``[B]`` sorted, unique absolute positions, all < N.

    Returns:
        None; ``k_cache[:, :, positions] = k_new`` and ``v_cache[:, :, positions] = v_new`` afterwards (Eq. 21).

    Raises:
        ValueError: as ``check_scatter_shapes`` and ``as_positions``, before anything is written.

    Source: Eq. 21, appendix 13.2 ("Torch indexed writes are the default").
    """
    pos = as_positions(positions)
    check_scatter_shapes(k_cache, v_cache, k_new, v_new, pos.numel(), int(pos.max()) if pos.numel() else -1)
    pos = pos.to(k_cache.device)
    k_cache.index_copy_(2, pos, k_new)
    v_cache.index_copy_(2, pos, v_new)
