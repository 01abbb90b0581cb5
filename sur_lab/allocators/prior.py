"""Prior-work-derived allocators and the clean-state oracle, each as Table 1 (appendix 7.4) states it.

Every allocator turns a per-position score into the exact top-B suffix support with earlier-position tie-breaking
(:func:`sur_lab.allocators.base.top_b`), except SpecCache-Adapted, which selects spans. Attention-derived signals use
:func:`sur_lab.allocators.signals.attention_probe`, which forms only the forwarded rows' attention (query tokens or a
64-token replay chunk), never an ``N × N`` matrix. Layer indices start at zero; layer 1 is the first contextual KV
layer (the layer-0 K/V of a token depend on the token and its position only).

Signal-acquisition cost is reported as ``Selection.extra_forward_tokens`` (tokens forwarded for the signal, 0 for
score-free rules) with ``diagnostics["extra_forward_layers"]``, the number of decoder layers those tokens traverse
(``L`` for a full forward, 2 for the shallow CacheBlend/A3 prefill; the auxiliary model's depth for SpecCache).

Options read from ``AllocationRequest.options``:

- ``"dirty_cache"``: the Dirty cache of ``p ⊕ e ⊕ s`` (``PreparedEdit.dirty_cache``), which repair starts from
  (Algorithm 1's input). Cache-Craft-Adapted reads the deleted span's keys from it; without it they are rebuilt by
  forwarding the span after Shift's valid prefix, and the d tokens are added to the reported cost.
- ``"aux_model"``: SpecCache-Adapted's auxiliary :class:`~sur_lab.models.LoadedModel` (see there for the default).
"""

from __future__ import annotations

import bisect
import functools
import math

import numpy as np
import torch
from transformers import DynamicCache

from sur_lab.allocators.base import (
    AllocationRequest,
    Selection,
    register_allocator,
    top_b,
)
from sur_lab.allocators.signals import (
    attention_probe,
    capture_residual_norms,
    decoder_layers,
    forward_layers,
)
from sur_lab.budget import Support
from sur_lab.cache_ops import (
    apply_rope,
    cache_length,
    clone_cache,
    from_tensors,
    layer_deviation,
    num_layers,
    slice_rows,
    to_tensors,
)
from sur_lab.executors import replay
from sur_lab.models import EMBEDDED_MODEL, LoadedModel, load_model

#: Cache-Craft-Adapted replays the dirty suffix in chunks of this many tokens (Table 1).
CACHE_CRAFT_CHUNK = 64
#: CacheBlend-Adapted and A3-Adapted run a fresh prefill through this many layers (Table 1).
SHALLOW_LAYERS = 2
#: The KV layer whose deviation (CacheBlend) or query attention (A3) is scored: the first contextual layer.
PROBE_LAYER = 1
#: LegoLink-Adapted splits the suffix into chunks of this many tokens (Table 1).
LEGOLINK_CHUNK = 512
#: SpecCache-Adapted smooth-span threshold, maximum span length (tokens) and completion coverage (Table 1).
SPECCACHE_THRESHOLD = 0.4
SPECCACHE_MAX_SPAN = 16
SPECCACHE_COVERAGE = 0.7


def _empty(S: int) -> Selection:
    return Selection(Support(np.zeros(0, dtype=np.int64), S))


def _shift_cache(request: AllocationRequest) -> DynamicCache:
    """The request's Shift cache, checked against the edit.

    Raises:
        ValueError: naming ``shift_cache`` when it is missing or does not hold the edit's ``p + S`` rows.
    """
    cache = request.shift_cache
    if cache is None:
        raise ValueError("this allocator reads the Shift cache: pass AllocationRequest(shift_cache=...)")
    if cache_length(cache) != request.edit.edited_len:
        raise ValueError(
            f"shift_cache has {cache_length(cache)} rows; this edit's Shift cache has {request.edit.edited_len}"
        )
    return cache


def _top_b_selection(scores: np.ndarray, request: AllocationRequest, **diagnostics) -> Selection:
    S, B = request.suffix_len, request.allowance
    tokens = int(diagnostics.pop("extra_forward_tokens", 0))
    return Selection(
        Support(top_b(scores, B), S), extra_forward_tokens=tokens, diagnostics={"scores": scores, **diagnostics}
    )


# ---------------------------------------------------------------------------------------------------------------------
# Query attention against the Shift cache: ProphetKV-Adapted, InfoFlow-Motivated


def query_attention_stats(lm: LoadedModel, shift_cache: DynamicCache, edit) -> tuple[np.ndarray, np.ndarray, int]:
    """Query-only forward against (a clone of) the Shift cache; per-suffix-position attention statistics (Table 1).

    With ``A[l, h, t, i]`` the attention of query token t (head h, layer l) to suffix position i:

    Returns:
        ``(mean [S], l2 [S], n)``: ``mean = sum_{l,h,t} A / (L · H_Q · Q)`` (ProphetKV-Adapted), ``l2 =
        sqrt(sum_{l,h,t} A²)`` (InfoFlow-Motivated), both float64, and ``n`` = Q, the forwarded query tokens.
    """
    p, S = edit.prefix_len, edit.suffix_len
    work = clone_cache(shift_cache)
    total = torch.zeros(S, dtype=torch.float64)
    squares = torch.zeros(S, dtype=torch.float64)
    count = {"rows": 0}

    def on_rows(layer: int, probs: torch.Tensor) -> None:
        cols = probs[:, :, p : p + S].double().cpu()
        total.add_(cols.sum(dim=(0, 1)))
        squares.add_(cols.square().sum(dim=(0, 1)))
        count["rows"] += probs.shape[0] * probs.shape[1]

    with attention_probe(lm, work, on_rows):
        forward_layers(lm, edit.query_ids, work)
    return (total / count["rows"]).numpy(), squares.sqrt().numpy(), int(edit.query_ids.numel())


@register_allocator("ProphetKV-Adapted")
def prophetkv_adapted(request: AllocationRequest) -> Selection:
    """Top-B by the query's attention to each suffix position, averaged uniformly over query tokens, heads and layers,
    from a query-only forward against the Shift cache (Table 1; Wang et al., 2026). Costs Q extra token-forwards."""
    S = request.suffix_len
    if request.allowance == 0:
        return _empty(S)
    mean, _, q = query_attention_stats(request.lm, _shift_cache(request), request.edit)
    return _top_b_selection(mean, request, extra_forward_tokens=q, extra_forward_layers=request.lm.spec.num_layers)


@register_allocator("InfoFlow-Motivated")
def infoflow_motivated(request: AllocationRequest) -> Selection:
    """Top-B by the L2 norm of the same query-to-suffix attention tensor over query tokens, heads and all layers
    (Table 1; Teng et al., 2026; not the original attention-mass formula, layer scope or chunk reordering)."""
    S = request.suffix_len
    if request.allowance == 0:
        return _empty(S)
    _, l2, q = query_attention_stats(request.lm, _shift_cache(request), request.edit)
    return _top_b_selection(l2, request, extra_forward_tokens=q, extra_forward_layers=request.lm.spec.num_layers)


# ---------------------------------------------------------------------------------------------------------------------
# Cache-Craft-Adapted: attention of the replayed dirty suffix to the deleted keys


def deleted_attention_mass(
    lm: LoadedModel,
    edit,
    shift_cache: DynamicCache,
    dirty_cache: DynamicCache | None = None,
    *,
    chunk: int = CACHE_CRAFT_CHUNK,
) -> tuple[np.ndarray, int]:
    """Each retained token's attention mass on the deleted keys, averaged over heads and layers (Table 1).

    The dirty suffix ``s`` is replayed at its original positions ``p + d + i`` in ``chunk``-token pieces on top of the
    rows ``[0, p + d)`` of the Dirty cache (prefix and the still-visible deleted span). For suffix token i,
    ``score_i = mean_{l,h} sum_{j in [p, p+d)} A[l, h, i, j]``.

    Args:
        lm: the model.
        edit: the edit.
        shift_cache: the Shift cache (its valid prefix rows rebuild the span's K/V when ``dirty_cache`` is ``None``).
        dirty_cache: the Dirty cache (N rows), or ``None``.
        chunk: replay chunk, tokens (64).

    Returns:
        ``(scores float64 [S], extra_forward_tokens)``: S, plus d when the span had to be rebuilt.

    Raises:
        ValueError: if ``chunk`` < 1, or ``dirty_cache`` does not hold the edit's N rows.
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    p, d, S = edit.prefix_len, edit.deleted_len, edit.suffix_len
    cost = S
    if dirty_cache is not None and cache_length(dirty_cache) != edit.num_tokens:
        raise ValueError(
            f"dirty_cache has {cache_length(dirty_cache)} rows; this edit's Dirty cache has {edit.num_tokens}"
        )
    if dirty_cache is not None:
        work = slice_rows(dirty_cache, 0, p + d)
    else:
        work = slice_rows(shift_cache, 0, p)
        forward_layers(lm, edit.original_ids[p : p + d], work)
        cost += d
    scores = torch.zeros(S, dtype=torch.float64)
    state = {"lo": 0}

    def on_rows(layer: int, probs: torch.Tensor) -> None:
        mass = probs[:, :, p : p + d].sum(dim=-1).mean(dim=0).double().cpu()  # (T,)
        lo = state["lo"]
        scores[lo : lo + mass.numel()] += mass

    suffix = edit.suffix_ids
    with attention_probe(lm, work, on_rows):
        for lo in range(0, S, chunk):
            state["lo"] = lo
            forward_layers(lm, suffix[lo : lo + chunk], work)
    return (scores / lm.spec.num_layers).numpy(), cost


@register_allocator("Cache-Craft-Adapted")
def cache_craft_adapted(request: AllocationRequest) -> Selection:
    """Top-B by attention mass on the deleted keys during a 64-token-chunk replay of the dirty suffix (Table 1;
    Agarwal et al., 2025). Costs S token-forwards (plus d without ``options["dirty_cache"]``)."""
    S = request.suffix_len
    if request.allowance == 0:
        return _empty(S)
    scores, cost = deleted_attention_mass(
        request.lm, request.edit, _shift_cache(request), request.options.get("dirty_cache")
    )
    return _top_b_selection(scores, request, extra_forward_tokens=cost, extra_forward_layers=request.lm.spec.num_layers)


# ---------------------------------------------------------------------------------------------------------------------
# Shallow fresh prefill: CacheBlend-Adapted, A3-Adapted


def shallow_prefill(lm: LoadedModel, ids: torch.Tensor, layers: int = SHALLOW_LAYERS) -> DynamicCache:
    """A fresh prefill of ``ids`` ``[n]`` through the first ``layers`` decoder layers; the cache holds those layers."""
    cache = DynamicCache()
    forward_layers(lm, ids, cache, layers)
    return cache


def kv_deviation_layer1(lm: LoadedModel, edit, shift_cache: DynamicCache) -> np.ndarray:
    """``||ΔK_{1,i}||² + ||ΔV_{1,i}||²`` between a fresh two-layer edited prefill and the Shift cache at layer 1,
    per suffix position (summed over KV heads and head dims), float64 ``[S]`` (Table 1, CacheBlend-Adapted).

    Raises:
        ValueError: if the model has fewer than two layers.
    """
    if lm.spec.num_layers < SHALLOW_LAYERS:
        raise ValueError(f"the model has {lm.spec.num_layers} layers; CacheBlend-Adapted needs {SHALLOW_LAYERS}")
    fresh = shallow_prefill(lm, edit.edited_ids)
    p = edit.prefix_len
    rows = slice(p, edit.edited_len)
    return layer_deviation(fresh, _first_layers(shift_cache, SHALLOW_LAYERS), rows)[PROBE_LAYER].cpu().numpy()


def _first_layers(cache: DynamicCache, n: int) -> DynamicCache:
    return from_tensors(to_tensors(cache)[:n])


@register_allocator("CacheBlend-Adapted")
def cacheblend_adapted(request: AllocationRequest) -> Selection:
    """Top-B by layer-1 K/V deviation of a fresh two-layer edited prefill from Shift; the one support is refreshed
    through all layers (Table 1; Yao et al., 2025). Costs p + S token-forwards through 2 layers."""
    S = request.suffix_len
    if request.allowance == 0:
        return _empty(S)
    scores = kv_deviation_layer1(request.lm, request.edit, _shift_cache(request))
    return _top_b_selection(
        scores, request, extra_forward_tokens=request.edit.edited_len, extra_forward_layers=SHALLOW_LAYERS
    )


def shallow_query_attention(lm: LoadedModel, edit) -> np.ndarray:
    """Layer-1 attention of the query to each suffix position, summed over heads and query positions, after a fresh
    two-layer edited prefill and a two-layer query forward (Table 1, A3-Adapted); float64 ``[S]``.

    Raises:
        ValueError: if the model has fewer than two layers.
    """
    if lm.spec.num_layers < SHALLOW_LAYERS:
        raise ValueError(f"the model has {lm.spec.num_layers} layers; A3-Adapted needs {SHALLOW_LAYERS}")
    p, S = edit.prefix_len, edit.suffix_len
    work = shallow_prefill(lm, edit.edited_ids)
    scores = torch.zeros(S, dtype=torch.float64)

    def on_rows(layer: int, probs: torch.Tensor) -> None:
        scores.add_(probs[:, :, p : p + S].sum(dim=(0, 1)).double().cpu())

    with attention_probe(lm, work, on_rows, layers=[PROBE_LAYER]):
        forward_layers(lm, edit.query_ids, work, SHALLOW_LAYERS)
    return scores.numpy()


@register_allocator("A3-Adapted")
def a3_adapted(request: AllocationRequest) -> Selection:
    """Top-B by layer-1 query-to-context attention after a shallow edited prefill and query forward (Table 1; Zhou et
    al., 2025). Costs p + S + Q token-forwards through 2 layers."""
    S = request.suffix_len
    if request.allowance == 0:
        return _empty(S)
    scores = shallow_query_attention(request.lm, request.edit)
    cost = request.edit.edited_len + int(request.edit.query_ids.numel())
    return _top_b_selection(scores, request, extra_forward_tokens=cost, extra_forward_layers=SHALLOW_LAYERS)


# ---------------------------------------------------------------------------------------------------------------------
# Chunk geometry: LegoLink-Adapted


def legolink_order(suffix_len: int, chunk: int = LEGOLINK_CHUNK) -> np.ndarray:
    """Suffix positions ranked by depth from their chunk's start, then by chunk index (Table 1, LegoLink-Adapted).

    The valid prefix is chunk 0 and the suffix is split into ``chunk``-token chunks 1, 2, ...; position i has depth
    ``i mod chunk`` and chunk index ``1 + i // chunk``. Depths beyond LegoLink's native 32 tokens are the extension the
    common budget grid requires.

    Returns:
        int64 ``[S]``, the ranking (first = refreshed first).

    Raises:
        ValueError: if ``chunk`` < 1 or ``suffix_len`` < 0.
    """
    if chunk < 1 or suffix_len < 0:
        raise ValueError(f"need chunk >= 1 and suffix_len >= 0; got chunk={chunk}, suffix_len={suffix_len}")
    i = np.arange(suffix_len, dtype=np.int64)
    return np.lexsort((1 + i // chunk, i % chunk))


@register_allocator("LegoLink-Adapted")
def legolink_adapted(request: AllocationRequest) -> Selection:
    """The first B positions of :func:`legolink_order` (Table 1; Hu et al., 2025). No forwards."""
    S, B = request.suffix_len, request.allowance
    if B == 0:
        return _empty(S)
    order = legolink_order(S)
    return Selection(Support(np.sort(order[:B]), S), diagnostics={"order": order})


# ---------------------------------------------------------------------------------------------------------------------
# Low-frequency reconstructed K/V magnitude: CacheTune-Adapted


def kept_rfft_bins(suffix_len: int) -> int:
    """``⌊0.5 (⌊S/2⌋ + 1)⌋``: the lowest rFFT bins CacheTune-Adapted keeps of a length-S sequence (Table 1)."""
    return (suffix_len // 2 + 1) // 2


def lowpass(x: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Keep the lowest :func:`kept_rfft_bins` rFFT bins of ``x`` along ``dim`` (FP32) and transform back.

    Args:
        x: any float tensor; the sequence axis is ``dim`` (length S).

    Returns:
        float32 tensor of ``x``'s shape.
    """
    n = x.shape[dim]
    spectrum = torch.fft.rfft(x.float(), dim=dim)
    keep = kept_rfft_bins(n)
    index = [slice(None)] * spectrum.dim()
    index[dim] = slice(keep, None)
    spectrum[tuple(index)] = 0
    return torch.fft.irfft(spectrum, n=n, dim=dim)


def unrotate_keys(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Remove RoPE from post-RoPE keys ``[..., n, d_h]`` at ``positions`` ``[n]`` (float64 angles; returns FP32).

    Only the leading ``2 * len(inv_freq)`` dimensions are rotated (all of them but for partial rotary, GLM-4.5)."""
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().float().to(keys.device), emb.sin().float().to(keys.device)
    return apply_rope(keys.float(), cos, -sin)


def lowpass_kv_scores(lm: LoadedModel, edit, shift_cache: DynamicCache) -> np.ndarray:
    """CacheTune-Adapted score per suffix position, float64 ``[S]`` (Table 1).

    Per layer: un-rotate the Shift cache's suffix keys from their compacted positions ``p + i``; low-pass keys and
    values along the suffix axis (:func:`lowpass`); take each position's unsquared L2 norm per KV head for keys and for
    values and average those 2·H_kv norms; divide by the layer's sum over positions (a layer summing to 0 contributes
    0); average across layers.
    """
    p, S = edit.prefix_len, edit.suffix_len
    positions = torch.arange(p, p + S)
    inv_freq = lm.inv_freq
    total = torch.zeros(S, dtype=torch.float64)
    for k, v in to_tensors(shift_cache):
        keys = unrotate_keys(k[0, :, p : p + S], positions, inv_freq)  # (H_kv, S, d_h)
        k_lp, v_lp = lowpass(keys, dim=1), lowpass(v[0, :, p : p + S], dim=1)
        norms = torch.cat((k_lp.norm(dim=-1), v_lp.norm(dim=-1)), dim=0).double().mean(dim=0).cpu()  # (S,)
        denom = norms.sum()
        if denom > 0:
            total += norms / denom
    return (total / num_layers(shift_cache)).numpy()


@register_allocator("CacheTune-Adapted")
def cachetune_adapted(request: AllocationRequest) -> Selection:
    """Top-B by low-frequency reconstructed K/V magnitude of the Shift cache (Table 1; Li et al., 2026a).

    No forwards."""
    S = request.suffix_len
    if request.allowance == 0:
        return _empty(S)
    return _top_b_selection(lowpass_kv_scores(request.lm, request.edit, _shift_cache(request)), request)


# ---------------------------------------------------------------------------------------------------------------------
# Auxiliary-model hidden-state norms with span selection: SpecCache-Adapted


@functools.lru_cache(maxsize=1)
def _embedded_model() -> LoadedModel:
    return load_model()


def default_aux_model(lm: LoadedModel, edit) -> LoadedModel:
    """SpecCache-Adapted's default auxiliary model: the embedded SmolLM2-135M-Instruct.

    The paper uses a fixed Llama-3.2-1B-Instruct; the embedded model replaces it by default so that the allocator runs
    offline. When ``lm`` is the embedded model, or the edit has no text to re-tokenize, ``lm`` itself is used.
    """
    if lm.spec.name == EMBEDDED_MODEL or edit.edited_text is None or lm.tokenizer is None:
        return lm
    return _embedded_model()


def hidden_norm_scores(aux: LoadedModel, ids: torch.Tensor) -> np.ndarray:
    """Mean over the auxiliary model's last third of layers (the last ``⌈L/3⌉``) of each token's hidden-state L2
    norm, from a fresh prefill of ``ids`` ``[n]``; float64 ``[n]`` (Table 1, SpecCache-Adapted)."""
    L = len(decoder_layers(aux))
    layers = list(range(L - math.ceil(L / 3), L))
    store: dict[int, torch.Tensor] = {}
    with capture_residual_norms(aux, layers, store):
        forward_layers(aux, ids.to(aux.device), DynamicCache())
    return torch.stack([store[l] for l in layers]).double().mean(dim=0).numpy()


def threshold_spans(active: np.ndarray, max_len: int = SPECCACHE_MAX_SPAN) -> list[tuple[int, int]]:
    """Maximal runs of ``True`` in ``active`` ``[n]``, each split into balanced pieces of at most ``max_len`` tokens.

    Raises:
        ValueError: if ``max_len`` < 1.
    """
    if max_len < 1:
        raise ValueError(f"max_len={max_len} must be >= 1")
    idx = np.flatnonzero(np.asarray(active, dtype=bool))
    if len(idx) == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1)
    starts = np.concatenate(([idx[0]], idx[breaks + 1])).tolist()
    ends = np.concatenate((idx[breaks] + 1, [idx[-1] + 1])).tolist()
    spans = []
    for a, b in zip(starts, ends):
        pieces = -(-(b - a) // max_len)
        base, extra = divmod(b - a, pieces)
        for k in range(pieces):
            size = base + (1 if k < extra else 0)
            spans.append((a, a + size))
            a += size
    return spans


def complete_spans(
    spans: list[tuple[int, int]], max_len: int = SPECCACHE_MAX_SPAN, coverage: float = SPECCACHE_COVERAGE
) -> list[tuple[int, int]]:
    """Completion: left to right, merge a span into the previous (merged) one, filling the gap, when the merged extent
    is at most ``max_len`` tokens and the spans cover at least ``coverage`` of it."""
    merged: list[tuple[int, int, int]] = []  # (start, end, covered tokens)
    for a, b in spans:
        if merged:
            ma, _, covered = merged[-1]
            extent = b - ma
            if extent <= max_len and (covered + b - a) / extent >= coverage:
                merged[-1] = (ma, b, covered + b - a)
                continue
        merged.append((a, b, b - a))
    return [(a, b) for a, b, _ in merged]


def smooth_spans(
    scores: np.ndarray,
    *,
    threshold: float = SPECCACHE_THRESHOLD,
    max_len: int = SPECCACHE_MAX_SPAN,
    coverage: float = SPECCACHE_COVERAGE,
) -> tuple[list[tuple[int, int]], np.ndarray]:
    """Smooth-span segmentation of a token-score sequence (our reading of Table 1's SpecCache-Adapted row).

    1. Min-max normalize the scores to ``z`` in [0, 1] (all 0 when constant) and smooth with a centred 3-token moving
       average (edges replicated).
    2. Spans are the maximal runs with smoothed ``z >= threshold``, split into pieces of at most ``max_len`` tokens
       (:func:`threshold_spans`).
    3. Completion at ``coverage`` (:func:`complete_spans`).

    Returns:
        ``(spans, z)``: half-open ``(start, end)`` spans in order, and ``z`` float64 ``[n]`` (unsmoothed).
    """
    s = np.asarray(scores, dtype=np.float64)
    if len(s) == 0:
        return [], s
    lo, hi = s.min(), s.max()
    z = (s - lo) / (hi - lo) if hi > lo else np.zeros_like(s)
    smooth = np.convolve(np.concatenate((z[:1], z, z[-1:])), np.ones(3) / 3.0, mode="valid")
    return complete_spans(threshold_spans(smooth >= threshold, max_len), max_len, coverage), z


def _aux_suffix_map(edit, aux: LoadedModel, lm: LoadedModel) -> tuple[torch.Tensor, np.ndarray, int]:
    """Tokenize the edited text for the auxiliary model and map its tokens to target suffix positions.

    Returns:
        ``(aux_ids [n], target_of_aux [n] int64, suffix_first)``: ``target_of_aux[j]`` is the suffix position (or -1)
        whose character span holds aux token j's midpoint; ``suffix_first`` is the first aux token in the suffix.
    """
    p, S = edit.prefix_len, edit.suffix_len
    if aux is lm:
        ids = edit.edited_ids
        target = np.concatenate((np.full(p, -1, dtype=np.int64), np.arange(S, dtype=np.int64)))
        return ids, target, p
    if edit.edited_text is None or edit.edited_offsets is None:
        raise ValueError("SpecCache-Adapted with a different auxiliary model needs an edit built from text")
    enc = aux.tokenizer(edit.edited_text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    target_starts = [edit.edited_offsets[p + i][0] for i in range(S)]
    suffix_char = target_starts[0] if S else len(edit.edited_text)
    target = np.full(len(ids), -1, dtype=np.int64)
    first = len(ids)
    for j, (a, b) in enumerate(enc["offset_mapping"]):
        mid = (a + b) / 2.0
        if mid < suffix_char or b <= a:
            continue
        first = min(first, j)
        target[j] = max(0, bisect.bisect_right(target_starts, mid) - 1)
    return ids, target, first


def speccache_positions(
    spans: list[tuple[int, int]], z: np.ndarray, target_of_aux: np.ndarray, suffix_len: int, budget: int
) -> np.ndarray:
    """Map ranked auxiliary-token spans to target suffix positions and fill exactly ``budget`` of them.

    Spans are visited by decreasing mean ``z`` (earlier span first among ties); each adds the target positions its
    tokens map to, truncated to its first positions when it would overflow. If the spans run out, the remaining
    positions are the unselected ones with the highest score (the largest ``z`` of an aux token mapped to them),
    earlier first. Returns sorted int64 ``[budget]``.
    """
    token_score = np.full(suffix_len, -np.inf)
    np.maximum.at(token_score, target_of_aux[target_of_aux >= 0], z[target_of_aux >= 0])
    means = np.array([z[a:b].mean() for a, b in spans]) if spans else np.zeros(0)
    starts = np.array([a for a, _ in spans], dtype=np.int64)
    chosen = np.zeros(suffix_len, dtype=bool)
    remaining = budget
    for k in np.lexsort((starts, -means)) if spans else []:
        a, b = spans[int(k)]
        mapped = np.unique(target_of_aux[a:b][target_of_aux[a:b] >= 0])
        mapped = mapped[~chosen[mapped]]
        take = mapped[:remaining]
        chosen[take] = True
        remaining -= len(take)
        if remaining == 0:
            break
    if remaining > 0:
        rest = np.flatnonzero(~chosen)
        fill = rest[top_b(token_score[rest], remaining)]
        chosen[fill] = True
    return np.flatnonzero(chosen).astype(np.int64)


@register_allocator("SpecCache-Adapted")
def speccache_adapted(request: AllocationRequest) -> Selection:
    """Auxiliary-model hidden-state norms, smooth spans, span-to-token mapping, exact-budget fill (Table 1; Wen et al.,
    2026).

    The auxiliary model is ``options["aux_model"]`` or :func:`default_aux_model` (the embedded SmolLM2-135M-Instruct;
    the paper's is Llama-3.2-1B-Instruct). It prefills the edited pre-query text (its own tokenization); token scores
    are :func:`hidden_norm_scores`; spans are :func:`smooth_spans` over the suffix's aux tokens; source-text spans map
    to target tokens by character midpoints (:func:`speccache_positions`). Costs the aux tokens of ``p ⊕ s``
    (forwarded through the aux model's layers).

    Diagnostics: ``aux_model``, ``spans`` (aux-token, suffix-relative), ``z`` (normalized aux scores of the suffix).
    """
    S, B = request.suffix_len, request.allowance
    if B == 0:
        return _empty(S)
    aux = request.options.get("aux_model") or default_aux_model(request.lm, request.edit)
    ids, target, first = _aux_suffix_map(request.edit, aux, request.lm)
    scores = hidden_norm_scores(aux, ids)[first:]
    spans, z = smooth_spans(scores)
    positions = speccache_positions(spans, z, target[first:], S, B)
    return Selection(
        Support(positions, S),
        extra_forward_tokens=int(ids.numel()),
        diagnostics={
            "aux_model": aux.spec.name, "spans": spans, "z": z, "extra_forward_layers": aux.spec.num_layers,
        },
    )


# ---------------------------------------------------------------------------------------------------------------------
# Clean-state oracle


def clean_deviation(lm: LoadedModel, edit, shift_cache: DynamicCache) -> np.ndarray:
    """All-layer K/V L2 deviation between Shift and the fully recomputed edited cache, per suffix position.

    ``score_i = sqrt(sum_l ||ΔK_{l,i}||² + ||ΔV_{l,i}||²)`` over every layer, KV head and head dim (float64
    ``[S]``), where the clean cache is Replay from Shift's valid prefix (equal to Re-prefill's rows up to rounding).
    """
    clean = replay(lm, shift_cache, edit)
    rows = slice(edit.prefix_len, edit.edited_len)
    return layer_deviation(shift_cache, clean, rows).sum(dim=0).sqrt().cpu().numpy()


@register_allocator("Clean-state oracle")
def clean_state_oracle(request: AllocationRequest) -> Selection:
    """Top-B by all-layer K/V deviation from a clean recomputation; privileged: it needs the full suffix recomputation
    (S token-forwards) to obtain its signal, and is neither an optimal support nor an accuracy upper bound (Table 1)."""
    S = request.suffix_len
    if request.allowance == 0:
        return _empty(S)
    scores = clean_deviation(request.lm, request.edit, _shift_cache(request))
    return _top_b_selection(scores, request, extra_forward_tokens=S, extra_forward_layers=request.lm.spec.num_layers)
