"""Triton indexed attention and indexed K/V writes for the packed executor (appendix 13.2, Eq. 21-24).

Packed attention evaluates B selected query rows at sorted absolute positions U = (u_1 < ... < u_B) against a KV cache
of N positions, each row seeing keys 0..u_r inclusive (Eq. 22):

    O_r = softmax(q_r K_{0:u_r}^T * scale) V_{0:u_r}

Layout is transformers' ``(batch=1, heads, seq_len, head_dim)``: q ``[1, Hq, B, D]``, k and v ``[1, Hkv, N, D]``; query
head h reads KV head ``h // (Hq // Hkv)`` (``repeat_kv``). Nothing here moves tokens, so no key is re-rotated.

The kernel tiles 16 packed rows x 64 K/V positions. A reusable plan (built once per refresh, O(B), no B x N mask) gives
each query tile its complete-prefix tile count n_full (Eq. 23), whose tiles are visible to every row and skip the
per-element mask, and its total tile count n_total (Eq. 24); tiles n_full..n_total-1 apply ``j <= u_r``. Online softmax
and tiled accumulation follow the IO-aware attention of Dao et al. (2022) as in Triton's fused-attention tutorial.
Probabilities and the accumulator stay in FP32; ``P @ V`` uses TF32x3 products on the GPU rather than rounding P to
BF16/FP16 (not IEEE-exact FP32).

Backends (see ``uses_triton``):
    * CUDA tensors: the compiled Triton kernels (NVIDIA SM80+, checked), four warps, two stages.
    * CPU tensors with ``TRITON_INTERPRET=1`` in the environment *when this module was imported* (Triton's decorators
      read it then): the same kernels under Triton's interpreter (slow; for tests).
    * Otherwise (CPU without the interpreter, or no Triton installed): the PyTorch references
      ``packed_sdpa_reference`` / ``indexed_scatter_kv_reference``; same validation, same results up to rounding.

Interpreter quirks (triton 3.9): ``tl.dot`` on bf16 operands returns garbage because bf16 tiles are held as uint16
arrays, while fp16/fp32 dots and bf16 -> fp32 conversions are exact; and FP32 -> bf16 ``.to()`` truncates instead of
rounding to nearest (with explicit ``"rtne"`` it can carry into the exponent wrongly). Under the interpreter bf16 Q/K
tiles are therefore converted to FP32 before the dot (constexpr ``UPCAST_BF16``) and the output is written as FP32 and
rounded by torch. The native bf16 dot and bf16 store run on GPUs only and are tested only where CUDA is present.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sur_lab.executors.kernels.reference import (
    as_positions,
    check_attention_shapes,
    check_scatter_shapes,
    indexed_scatter_kv_reference,
    packed_sdpa_reference,
)

try:  # Triton is an optional dependency (pyproject extra "triton"); every entry point has a PyTorch fallback.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on installs without Triton
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "TRITON_INTERPRETED",
    "IndexedAttentionPlan",
    "build_indexed_attention_plan",
    "indexed_attention",
    "indexed_scatter_kv",
    "uses_triton",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128)
BLOCK_M = 16  # packed query rows per tile (appendix 13.2)
BLOCK_N = 64  # K/V positions per tile (appendix 13.2; the 64 of Eq. 23-24)
SCATTER_BLOCK_B = 16  # packed rows written per program by the indexed scatter
NUM_WARPS = 4
NUM_STAGES = 2


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensor fields with == is elementwise, not a bool
class IndexedAttentionPlan:
    """Per-refresh metadata for ``indexed_attention``, reusable across layers (appendix 13.2, Eq. 23-24).

    Attributes:
        positions: ``[B]`` int64, sorted strictly increasing absolute positions U (tokens).
        n_full: ``[T]`` int32, T = ceil(B / block_m); for query tile t with first position u_min,
            ``floor((u_min + 1) / block_n)`` K/V tiles are complete prefix, visible to every row (Eq. 23).
        n_total: ``[T]`` int32, ``ceil((u_max + 1) / block_n)`` K/V tiles visited in all, u_max the tile's last
            position (Eq. 24).
        max_position: u_B as a Python int (-1 when B = 0), so per-layer bounds checks need no device sync.
        block_m: packed query rows per tile.
        block_n: K/V positions per tile.

    All tensors live on the device of the positions the plan was built from.
    """

    positions: torch.Tensor
    n_full: torch.Tensor
    n_total: torch.Tensor
    max_position: int
    block_m: int = BLOCK_M
    block_n: int = BLOCK_N

    @property
    def num_rows(self) -> int:
        """B, the number of packed query rows."""
        return self.positions.numel()

    @property
    def num_tiles(self) -> int:
        """T, the number of query tiles (the first grid axis)."""
        return self.n_full.numel()

    @property
    def device(self) -> torch.device:
        return self.positions.device


def build_indexed_attention_plan(
    positions: torch.Tensor | Sequence[int], *, block_m: int = BLOCK_M, block_n: int = BLOCK_N
) -> IndexedAttentionPlan:
    """Build the reusable tile plan for ``indexed_attention`` in O(B), without any B x N mask.

    Args:
        positions: ``[B]`` absolute zero-based positions U (tokens), integer dtype or a sequence of ints, sorted
            strictly increasing and non-negative. The plan stays on their device (a sequence gives a CPU plan).
        block_m: packed query rows per tile, a power of two >= 16 (``tl.dot`` needs 16 rows).
        block_n: K/V positions per tile, a power of two >= 16.

    Returns:
        ``IndexedAttentionPlan`` whose query tile t covers rows ``t*block_m .. min((t+1)*block_m, B) - 1`` with
        ``n_full[t] = floor((u_min + 1) / block_n)`` (Eq. 23) and ``n_total[t] = ceil((u_max + 1) / block_n)``
        (Eq. 24), u_min / u_max the tile's first / last position.

    Raises:
        ValueError: naming ``positions`` if not 1-D integer, negative, unsorted, duplicated or >= 2**31 - block_n
            (int32 tile arithmetic); naming ``block_m`` or ``block_n`` if not a power of two >= 16.

    Source: appendix 13.2, "Reusable execution plan", Eq. 23-24.
    """
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
    pos = as_positions(positions).clone()  # the frozen plan must not see later in-place edits of the caller's tensor
    b = pos.numel()
    max_position = int(pos[-1]) if b else -1
    if max_position + block_n >= 2**31:
        # Kernels index K/V rows with int32 tile offsets, and the tile counts are int32.
        raise ValueError(f"positions must be < 2**31 - block_n = {2**31 - block_n}, got max {max_position}")
    num_tiles = -(-b // block_m)
    # Sorted positions make each tile's extremes its first and last rows: O(B) gathers, no per-tile reduction.
    u_min = pos[::block_m]
    last_row = (torch.arange(num_tiles, device=pos.device) * block_m + (block_m - 1)).clamp_max(max(b - 1, 0))
    u_max = pos[last_row]
    n_full = torch.div(u_min + 1, block_n, rounding_mode="floor").to(torch.int32)
    n_total = torch.div(u_max + block_n, block_n, rounding_mode="floor").to(torch.int32)  # ceil((u + 1) / block_n)
    return IndexedAttentionPlan(pos, n_full, n_total, max_position, block_m, block_n)


if HAS_TRITON:

    @triton.jit
    def _attn_kv_tiles(
        acc, l_i, m_i, q, pos, kv_end,
        k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        tile_lo, tile_hi, qk_scale,
        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
        MASKED: tl.constexpr, QK_FP32: tl.constexpr, UPCAST_BF16: tl.constexpr,
    ):  # fmt: skip
        offs_d = tl.arange(0, HEAD_DIM)
        for tile in range(tile_lo, tile_hi):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            # K is read transposed, [HEAD_DIM, BLOCK_N], so the score tile is a plain q @ k.
            k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
            v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
            if MASKED:
                # Partially visible tile: never read past the tile's last selected position (this also keeps the
                # last tile inside the cache when N is not a multiple of BLOCK_N).
                k = tl.load(k_ptrs, mask=offs_n[None, :] < kv_end, other=0.0)
                v = tl.load(v_ptrs, mask=offs_n[:, None] < kv_end, other=0.0)
            else:
                # Complete-prefix tile: every key is < u_min + 1 <= N, so no bounds or causal mask is needed.
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            if UPCAST_BF16:
                k = k.to(tl.float32)
            if QK_FP32:
                # FP32 operands: TF32x3 keeps ~FP32 accuracy on tensor cores (exact FP32 under the interpreter).
                qk = tl.dot(q, k, input_precision="tf32x3")
            else:
                qk = tl.dot(q, k)  # FP16/BF16 operands, FP32 accumulation
            # Work in base 2: exp(x * scale) = exp2(x * scale * log2(e)); qk_scale already holds the log2(e) factor.
            qk = qk * qk_scale
            if MASKED:
                qk = tl.where(offs_n[None, :] <= pos[:, None], qk, float("-inf"))
            # Tile 0 is always visited first and key 0 is visible to every row, so m_i is finite from then on and
            # fully masked rows in later tiles give exp2(-inf) = 0, never inf - inf.
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)  # rescales what was accumulated under the old running max
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            # P stays FP32 (not rounded to the input dtype); V is widened to match, TF32x3 products on the GPU.
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="tf32x3")
            m_i = m_ij
        return acc, l_i, m_i

    @triton.jit
    def _indexed_attn_fwd(
        Q, K, V, Out, Pos, NFull, NTotal, sm_scale,
        stride_qh, stride_qm, stride_qd,
        stride_kh, stride_kn, stride_kd,
        stride_vh, stride_vn, stride_vd,
        stride_oh, stride_om, stride_od,
        num_rows, kv_group,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
        QK_FP32: tl.constexpr, UPCAST_BF16: tl.constexpr,
    ):  # fmt: skip
        tile_m = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)  # int64: head * stride can pass 2**31 on long caches
        kv_head = head // kv_group  # repeat_kv mapping
        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < num_rows
        # Padding rows get position 0: they see key 0, so their softmax stays finite; they are never stored.
        pos = tl.load(Pos + offs_m, mask=row_ok, other=0)
        kv_end = tl.max(pos, 0) + 1
        q = tl.load(
            Q + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None],
            other=0.0,
        )
        if UPCAST_BF16:
            q = q.to(tl.float32)
        n_full = tl.load(NFull + tile_m)
        n_total = tl.load(NTotal + tile_m)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        qk_scale = sm_scale * 1.44269504  # log2(e) = 1/ln(2): scores go to base 2 for exp2
        k_base = K + kv_head * stride_kh
        v_base = V + kv_head * stride_vh
        acc, l_i, m_i = _attn_kv_tiles(
            acc, l_i, m_i, q, pos, kv_end, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            0, n_full, qk_scale, BLOCK_N, HEAD_DIM, False, QK_FP32, UPCAST_BF16,
        )  # fmt: skip
        acc, l_i, m_i = _attn_kv_tiles(
            acc, l_i, m_i, q, pos, kv_end, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            n_full, n_total, qk_scale, BLOCK_N, HEAD_DIM, True, QK_FP32, UPCAST_BF16,
        )  # fmt: skip
        out = acc / l_i[:, None]
        o_ptrs = Out + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _indexed_scatter_kv_fwd(
        KCache, VCache, KNew, VNew, Pos,
        stride_kch, stride_kcn, stride_kcd,
        stride_vch, stride_vcn, stride_vcd,
        stride_knh, stride_knb, stride_knd,
        stride_vnh, stride_vnb, stride_vnd,
        num_rows,
        BLOCK_B: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):  # fmt: skip
        tile_b = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        offs_b = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_b < num_rows
        pos = tl.load(Pos + offs_b, mask=row_ok, other=0)
        row_mask = row_ok[:, None]
        k_rows = tl.load(KNew + head * stride_knh + offs_b[:, None] * stride_knb + offs_d[None, :] * stride_knd,
                         mask=row_mask)  # fmt: skip
        v_rows = tl.load(VNew + head * stride_vnh + offs_b[:, None] * stride_vnb + offs_d[None, :] * stride_vnd,
                         mask=row_mask)  # fmt: skip
        tl.store(KCache + head * stride_kch + pos[:, None] * stride_kcn + offs_d[None, :] * stride_kcd, k_rows,
                 mask=row_mask)  # fmt: skip
        tl.store(VCache + head * stride_vch + pos[:, None] * stride_vcn + offs_d[None, :] * stride_vcd, v_rows,
                 mask=row_mask)  # fmt: skip

    # Triton's decorators chose JITFunction or InterpretedFunction from TRITON_INTERPRET at import time; the kernel
    # objects, not today's environment, say which one runs.
    TRITON_INTERPRETED = not isinstance(_indexed_attn_fwd, triton.runtime.JITFunction)
else:  # pragma: no cover
    TRITON_INTERPRETED = False


def uses_triton(device: torch.device | str) -> bool:
    """Whether ``indexed_attention`` / ``indexed_scatter_kv`` launch Triton for tensors on ``device``.

    True on CUDA when Triton is installed, and on the CPU when this module was imported with ``TRITON_INTERPRET=1``;
    otherwise the wrappers use the PyTorch references.
    """
    device = torch.device(device)
    return HAS_TRITON and (device.type == "cuda" or TRITON_INTERPRETED)


def _check_kernel_dtype_and_head_dim(t: torch.Tensor, name: str) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype must be float16, bfloat16 or float32, got {t.dtype}")
    if t.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name} head_dim must be 64 or 128, got {t.shape[-1]}")


def _check_int32_offsets(t: torch.Tensor, name: str) -> None:
    # Within a head, row and column offsets are int32 in the kernels (head offsets are int64).
    if (t.shape[2] - 1) * t.stride(2) + (t.shape[3] - 1) * t.stride(3) >= 2**31:
        raise ValueError(f"{name} is too long for int32 offsets within a head: shape {tuple(t.shape)}, strides "
                         f"{t.stride()}")  # fmt: skip


def _check_sm80(device: torch.device) -> None:
    if device.type == "cuda" and not TRITON_INTERPRETED and torch.cuda.get_device_capability(device) < (8, 0):
        # BF16 tensor-core dots and TF32x3 need Ampere; older GPUs should use packed_sdpa_reference.
        raise RuntimeError(f"indexed attention kernels need NVIDIA SM80+, got {torch.cuda.get_device_name(device)}")


def _as_plan(positions_or_plan: IndexedAttentionPlan | torch.Tensor | Sequence[int]) -> IndexedAttentionPlan:
    if isinstance(positions_or_plan, IndexedAttentionPlan):
        return positions_or_plan
    return build_indexed_attention_plan(positions_or_plan)


def indexed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions_or_plan: IndexedAttentionPlan | torch.Tensor | Sequence[int],
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention for B packed query rows at absolute positions U against a full KV cache.

    Args:
        q: ``[1, Hq, B, D]`` queries of the selected rows (after RoPE), float16, bfloat16 or float32; any strides.
        k: ``[1, Hkv, N, D]`` keys of the whole layer cache (after RoPE, fresh rows already written, Eq. 21), q's
            dtype and device, Hq a multiple of Hkv (query head h reads KV head ``h // (Hq // Hkv)``); any strides.
        v: ``[1, Hkv, N, D]`` values, like k.
        positions_or_plan: an ``IndexedAttentionPlan`` from ``build_indexed_attention_plan`` (reuse it across
            layers), or ``[B]`` sorted unique positions (a plan is built per call then). On q's device.
        scale: softmax scale; defaults to ``1 / sqrt(D)``.

    Returns:
        ``[1, Hq, B, D]`` contiguous, q's dtype: ``O_r = softmax(q_r K_{0:u_r}^T * scale) V_{0:u_r}``, keys
        0..u_r inclusive. Probabilities and accumulation in FP32. Forward only: the Triton path records no autograd
        graph (the executor runs in evaluation mode).

    Raises:
        ValueError: before any launch, naming ``q``/``k``/``v`` for ranks, batch != 1, head counts, dtypes other than
            float16/bfloat16/float32, head_dim other than 64/128, or device mismatches; naming ``positions`` for
            unsorted, duplicate, negative or out-of-range (>= N) positions, a row count other than B, or a plan on
            another device.
        RuntimeError: on CUDA devices older than SM80.

    Backend: Triton where ``uses_triton(q.device)``, else ``packed_sdpa_reference`` (CPU without
    ``TRITON_INTERPRET=1`` at import, or no Triton). Source: Eq. 22-24, appendix 13.2.
    """
    plan = _as_plan(positions_or_plan)
    _, hkv, b, n, d = check_attention_shapes(q, k, v, plan.num_rows, plan.max_position)
    _check_kernel_dtype_and_head_dim(q, "q")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_int32_offsets(t, name)
    if plan.device != q.device:
        raise ValueError(f"positions (plan) must be on q's device {q.device}, got {plan.device}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not uses_triton(q.device):
        return packed_sdpa_reference(q, k, v, plan.positions, scale=scale)
    _check_sm80(q.device)
    hq = q.shape[1]
    # Interpreter only: its bf16 dot is wrong, so bf16 tiles are widened to FP32 first, and its FP32 -> bf16 cast
    # truncates instead of rounding to nearest, so the kernel writes FP32 and torch rounds (module docstring).
    upcast_bf16 = TRITON_INTERPRETED and q.dtype == torch.bfloat16
    out = torch.empty((1, hq, b, d), dtype=torch.float32 if upcast_bf16 else q.dtype, device=q.device)
    if b == 0:
        return out.to(q.dtype)
    grid = (plan.num_tiles, hq)
    _indexed_attn_fwd[grid](
        q, k, v, out, plan.positions, plan.n_full, plan.n_total, scale,
        q.stride(1), q.stride(2), q.stride(3),
        k.stride(1), k.stride(2), k.stride(3),
        v.stride(1), v.stride(2), v.stride(3),
        out.stride(1), out.stride(2), out.stride(3),
        b, hq // hkv,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, HEAD_DIM=d,
        QK_FP32=q.dtype == torch.float32 or upcast_bf16, UPCAST_BF16=upcast_bf16,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out.to(q.dtype)


@torch.no_grad()
def indexed_scatter_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    positions: IndexedAttentionPlan | torch.Tensor | Sequence[int],
) -> None:
    """Write fresh K/V rows into a layer's caches at the selected positions in one launch. MUTATES the caches.

    Args:
        k_cache: ``[1, Hkv, N, D]`` keys, written in place (rows are written as given: no re-rotation).
        v_cache: ``[1, Hkv, N, D]`` values, written in place.
        k_new: ``[1, Hkv, B, D]`` fresh keys of the packed rows, the caches' dtype and device; any strides.
        v_new: ``[1, Hkv, B, D]`` fresh values.
        positions: ``[B]`` sorted unique positions < N, or an ``IndexedAttentionPlan`` (its positions are used).

    Returns:
        None; afterwards ``k_cache[:, :, u_r] = k_new[:, :, r]`` and likewise for v, all other rows untouched (Eq. 21).

    Raises:
        ValueError: before anything is written, as ``indexed_attention`` (dtype float16/bfloat16/float32, head_dim
            64/128, shapes, devices, positions), naming the argument.
        RuntimeError: on CUDA devices older than SM80.

    Scatter and attention are separate launches ordered on the same stream; no cross-program barrier is assumed.
    Backend as ``indexed_attention``; the fallback is ``indexed_scatter_kv_reference``. Source: Eq. 21, appendix 13.2
    ("Indexed attention and writes").
    """
    pos = positions.positions if isinstance(positions, IndexedAttentionPlan) else as_positions(positions)
    max_position = positions.max_position if isinstance(positions, IndexedAttentionPlan) else (
        int(pos[-1]) if pos.numel() else -1
    )
    hkv, b, _, d = check_scatter_shapes(k_cache, v_cache, k_new, v_new, pos.numel(), max_position)
    _check_kernel_dtype_and_head_dim(k_cache, "k_cache")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        _check_int32_offsets(t, name)
    if pos.device != k_cache.device:
        raise ValueError(f"positions must be on k_cache's device {k_cache.device}, got {pos.device}")
    if not uses_triton(k_cache.device):
        indexed_scatter_kv_reference(k_cache, v_cache, k_new, v_new, pos)
        return
    _check_sm80(k_cache.device)
    if b == 0:
        return
    grid = (triton.cdiv(b, SCATTER_BLOCK_B), hkv)
    _indexed_scatter_kv_fwd[grid](
        k_cache, v_cache, k_new, v_new, pos,
        k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        k_new.stride(1), k_new.stride(2), k_new.stride(3),
        v_new.stride(1), v_new.stride(2), v_new.stride(3),
        b,
        BLOCK_B=SCATTER_BLOCK_B, HEAD_DIM=d,
        num_warps=NUM_WARPS,
    )  # fmt: skip
