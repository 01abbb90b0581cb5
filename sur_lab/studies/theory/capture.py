"""Proposition 14.1 (appendix 14) on a real model: the capture of query vectors and attention outputs that evaluates
the bound of :mod:`~sur_lab.studies.theory.bound` (:func:`bound_study`), and the real-context case
(:func:`theory_edit`).

* **Proposition 14.1 on a real model.** :class:`AttentionCapture` records, during ordinary forwards, the query vectors
  (after Q/K normalization and RoPE, exactly as the model's attention function receives them) and the attention outputs
  of sampled layers and heads. :func:`refresh_with_queries` runs the interval-wise ``"sequential"`` executor under the
  capture (cache A and ``q^A`` of every refreshed position); :func:`replay_with_queries` does the same for full-suffix
  Replay (cache ⋆ and ``q^⋆``). Keys and values come from the final caches: in the interval-wise executor an interval
  ``[a, b)`` reads rows ``[0, a)`` that no later interval rewrites, plus its own fresh rows, so the final cache A holds
  exactly the K/V that refreshed position i attended to (likewise for Replay). Only the sampled heads' rows of the
  attention matrix are ever formed (``n_rows × N`` per head); no ``N × N`` matrix is built. :func:`bound_study` joins
  them into one row per (budget, layer, head, refreshed position). :func:`theory_edit` builds the real-context case.

Scaling: the capture records the ``scaling`` the model's attention modules carry (``d_h^{-1/2}`` for Llama, Mistral,
Qwen2 and Qwen3), which the bound uses in place of the paper's ``1 / √d_h``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from sur_lab.attention import attention_hook, native_implementation
from sur_lab.budget import Support
from sur_lab.cache_ops import layer_kv, slice_rows
from sur_lab.checks import as_count
from sur_lab.data.qa import is_held_out, load_corpus, load_example
from sur_lab.edits import EditedContext, chat_edit, format_passages
from sur_lab.executors import check_support, get_executor
from sur_lab.forward import forward_tokens
from sur_lab.models import LoadedModel
from sur_lab.studies.theory.bound import BoundTerms, bound_rounding_allowance, mixed_cache_bound

# ---------------------------------------------------------------------------------------------------------------------
# Capturing queries and attention outputs on a real model


@dataclass
class CapturedRows:
    """Queries and attention outputs recorded for one layer during forwards.

    Attributes:
        positions: ``[n]`` int64 absolute rows of the recorded queries, in recording order.
        queries: ``[H_s, n, d_h]`` queries of the sampled heads (post-normalization, post-RoPE), model dtype.
        outputs: ``[H_s, n, d_h]`` attention outputs of the sampled heads (before ``o_proj``), model dtype.
        scaling: the module's logit scale.
    """

    positions: torch.Tensor
    queries: torch.Tensor
    outputs: torch.Tensor
    scaling: float

    def rows(self, positions: torch.Tensor | Sequence[int]) -> "CapturedRows":
        """The recorded rows at ``positions`` (absolute), in the order given; the last record wins for repeats.

        Raises:
            ValueError: naming ``positions`` when one was never recorded.
        """
        want = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
        lookup = {int(p): r for r, p in enumerate(self.positions.tolist())}
        missing = [int(p) for p in want.tolist() if int(p) not in lookup]
        if missing:
            raise ValueError(f"positions {missing[:5]}... were not recorded (recorded {len(lookup)} rows)")
        idx = torch.tensor([lookup[int(p)] for p in want.tolist()], dtype=torch.long)
        return CapturedRows(want, self.queries[:, idx], self.outputs[:, idx], self.scaling)


class AttentionCapture:
    """Context manager recording queries and attention outputs of sampled layers and heads during forwards.

    While active, the model's attention function (``"sdpa"`` or ``"eager"``) is wrapped by a hook of the model's
    attention router (:func:`sur_lab.attention.attention_hook`) in the calling thread only: forwards of other threads,
    and of other models, are neither recorded nor changed. The wrapper receives exactly what the model's attention
    computes with: queries after projection, Q/K normalization and RoPE ``[1, H_Q, L, d_h]``, and the cache's
    keys/values after this forward's update ``[1, H_KV, N, d_h]``; it calls the original function unchanged, so forwards
    are bitwise what they are without the capture. Query rows are at absolute positions ``N − L .. N − 1`` (forwards
    append at the cache end).

    Args:
        lm: the model.
        layers: layer indices to record.
        heads: query-head indices to record (per layer the same heads); ``None`` = all heads.

    Attributes:
        records: after exit, ``{layer: CapturedRows}``.

    Raises:
        ValueError: naming ``layers`` or ``heads`` when out of range, or the attention implementation when it is
            neither ``"sdpa"`` nor ``"eager"`` (before any forward).
    """

    def __init__(self, lm: LoadedModel, layers: Iterable[int], heads: Iterable[int] | None = None):
        spec = lm.spec
        self.lm = lm
        self.layers = sorted({int(x) for x in layers})
        if any(not 0 <= x < spec.num_layers for x in self.layers):
            raise ValueError(f"layers={self.layers} must lie in [0, {spec.num_layers})")
        self.heads = list(range(spec.num_heads)) if heads is None else [int(h) for h in heads]
        if any(not 0 <= h < spec.num_heads for h in self.heads):
            raise ValueError(f"heads={self.heads} must lie in [0, {spec.num_heads})")
        self.impl = native_implementation(lm.model.config) or "eager"
        if self.impl not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation={self.impl!r}: the capture supports 'sdpa' and 'eager'")
        self._parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {x: [] for x in self.layers}
        self._scaling: dict[int, float] = {}
        self.records: dict[int, CapturedRows] = {}
        self._hook: Any = None

    def _wrapper(self) -> Callable:
        head_idx = torch.tensor(self.heads, dtype=torch.long)

        def capture(fn, module, query, key, value, attention_mask, **kwargs):
            out, weights = fn(module, query, key, value, attention_mask, **kwargs)
            layer = int(module.layer_idx)
            if layer in self._parts:
                n_keys, n_q = key.shape[-2], query.shape[-2]
                pos = torch.arange(n_keys - n_q, n_keys, dtype=torch.long)
                idx = head_idx.to(query.device)
                # query [1, H, L, d]; attention output [1, L, H, d] (transposed back by the attention function).
                self._parts[layer].append(
                    (pos, query[0, idx].detach().cpu().clone(), out[0][:, idx].transpose(0, 1).detach().cpu().clone())
                )
                self._scaling[layer] = float(kwargs.get("scaling", module.scaling))
            return out, weights

        return capture

    def __enter__(self) -> "AttentionCapture":
        self._hook = attention_hook(self.lm.model, self._wrapper())
        self._hook.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        hook, self._hook = self._hook, None
        hook.__exit__(*exc)
        for layer, parts in self._parts.items():
            if parts:
                self.records[layer] = CapturedRows(
                    torch.cat([p for p, _, _ in parts]),
                    torch.cat([q for _, q, _ in parts], dim=1),
                    torch.cat([o for _, _, o in parts], dim=1),
                    self._scaling[layer],
                )


@torch.inference_mode()
def refresh_with_queries(
    lm: LoadedModel,
    shift_cache: DynamicCache,
    edit: EditedContext,
    support: Support,
    layers: Iterable[int],
    heads: Iterable[int] | None = None,
) -> tuple[DynamicCache, dict[int, CapturedRows]]:
    """Interval-wise sparse refresh (the ``"sequential"`` executor) while recording queries of refreshed positions.

    Args:
        lm: the model.
        shift_cache: Shift cache (``p + S`` rows); not modified.
        edit: the edit.
        support: suffix positions to refresh.
        layers, heads: what to record (see :class:`AttentionCapture`).

    Returns:
        ``(cache_A, {layer: CapturedRows})`` where the rows are the support's absolute positions ``p + support``.

    Raises:
        ValueError: see :func:`sur_lab.executors.check_support` and :class:`AttentionCapture`.
    """
    check_support(edit, support, shift_cache)
    run = get_executor("sequential")
    with AttentionCapture(lm, layers, heads) as cap:
        cache = run(lm, shift_cache, edit, support)
    return cache, cap.records


@torch.inference_mode()
def replay_with_queries(
    lm: LoadedModel,
    dirty_cache: DynamicCache,
    edit: EditedContext,
    layers: Iterable[int],
    heads: Iterable[int] | None = None,
) -> tuple[DynamicCache, dict[int, CapturedRows]]:
    """Full-suffix Replay (valid prefix of ``dirty_cache`` + one forward of the suffix) while recording queries.

    Returns:
        ``(cache_⋆, {layer: CapturedRows})`` with rows at every suffix position ``p .. p + S − 1``.
    """
    out = slice_rows(dirty_cache, 0, edit.prefix_len)
    with AttentionCapture(lm, layers, heads) as cap:
        forward_tokens(lm, edit.suffix_ids, out, logits="none")
    return out, cap.records


def kv_head_of(head: int, spec) -> int:
    """GQA: the KV head read by query head ``head`` (``head // (H_Q / H_KV)``, as transformers' ``repeat_kv``)."""
    return int(head) // spec.gqa_group


def bound_rows(
    lm: LoadedModel,
    cache_a: DynamicCache,
    captured_a: dict[int, CapturedRows],
    cache_ref: DynamicCache,
    captured_ref: dict[int, CapturedRows],
    positions: torch.Tensor | Sequence[int],
    heads: Sequence[int],
    *,
    prefix_len: int = 0,
    extra: dict[str, Any] | None = None,
) -> "pd.DataFrame":  # noqa: F821 - pandas imported lazily
    """Proposition 14.1 terms for the captured layers, the given heads and absolute query ``positions``.

    Args:
        lm: the model (for the GQA head mapping).
        cache_a, captured_a: the mixed cache and its captured queries (:func:`refresh_with_queries`).
        cache_ref, captured_ref: the Replay cache and its captured queries (:func:`replay_with_queries`).
        positions: ``[n]`` absolute rows (refreshed positions) to evaluate.
        heads: query heads, in the order they were captured (the capture's ``heads``).
        prefix_len: p, to report suffix-local positions.
        extra: constant columns to add (budget, method ...).

    Returns:
        DataFrame with one row per (layer, head, position): ``layer, head, kv_head, position, suffix_pos, num_keys``,
        every :attr:`BoundTerms.SCALARS` field, ``capture_err`` (max-abs difference between the float64 recomputed
        ``o_i^A`` and the attention output the model produced), ``holds`` (``lhs ≤ bound25``), ``holds_26``
        (``logit_dev ≤ logit_bound26``), ``allowance`` (:func:`bound_rounding_allowance`) and ``slack``
        (``bound25 / lhs``).
    """
    pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    frames = []
    for layer in sorted(captured_a):
        rows_a = captured_a[layer].rows(pos)
        rows_ref = captured_ref[layer].rows(pos)
        ka, va = layer_kv(cache_a, layer)
        kr, vr = layer_kv(cache_ref, layer)
        kv = torch.tensor([kv_head_of(h, lm.spec) for h in heads], dtype=torch.long)
        terms = mixed_cache_bound(
            rows_a.queries, ka[0, kv].cpu(), va[0, kv].cpu(), rows_ref.queries, kr[0, kv].cpu(), vr[0, kv].cpu(),
            pos, scaling=rows_a.scaling,
        )
        err = (terms.o_a - rows_a.outputs.double()).abs().amax(-1)  # [H_s, n]
        allow = bound_rounding_allowance(terms, pos + 1)
        data = {name: getattr(terms, name).reshape(-1).numpy() for name in BoundTerms.SCALARS}
        n_h, n = len(heads), pos.numel()
        df = pd.DataFrame({
            "layer": layer,
            "head": np.repeat(np.asarray(heads), n),
            "kv_head": np.repeat(kv.numpy(), n),
            "position": np.tile(pos.numpy(), n_h),
            "suffix_pos": np.tile(pos.numpy() - prefix_len, n_h),
            "num_keys": np.tile(pos.numpy() + 1, n_h),
            **data,
            "capture_err": err.reshape(-1).numpy(),
            "allowance": allow.reshape(-1).numpy(),
        })
        frames.append(df)
    out = pd.concat(frames, ignore_index=True)
    out["holds"] = out["lhs"] <= out["bound25"]
    out["holds_26"] = out["logit_dev"] <= out["logit_bound26"]
    with np.errstate(divide="ignore", invalid="ignore"):
        out["slack"] = out["bound25"] / out["lhs"]
    for key, value in (extra or {}).items():
        out.insert(0, key, value)
    return out


def evenly_spaced_layers(num_layers: int, k: int) -> list[int]:
    """``k`` layer indices spread evenly over ``[0, num_layers)``, first and last included (all when k ≥ L).

    Raises:
        ValueError: naming ``k`` when it is below 1.
    """
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    if k >= num_layers:
        return list(range(num_layers))
    return sorted({int(round(x)) for x in np.linspace(0, num_layers - 1, k)})


def sample_rows(positions: np.ndarray, max_rows: int, seed: int) -> np.ndarray:
    """At most ``max_rows`` of ``positions`` chosen uniformly without replacement (seeded), sorted."""
    positions = np.asarray(positions, dtype=np.int64)
    if max_rows <= 0 or len(positions) <= max_rows:
        return np.sort(positions)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(positions, size=max_rows, replace=False))


def bound_study(
    lm: LoadedModel,
    prepared,
    supports: dict[Any, Support],
    *,
    layers: Sequence[int],
    heads: Sequence[int],
    max_rows: int = 64,
    seed: int = 0,
    replay_capture: tuple[DynamicCache, dict[int, CapturedRows]] | None = None,
    progress: bool = True,
) -> "pd.DataFrame":  # noqa: F821
    """Proposition 14.1 on a real model: every term for sampled refreshed positions, layers and heads.

    Replay (⋆) runs once with the capture (unless ``replay_capture`` is given); each support runs the interval-wise
    executor with the capture (A).

    Args:
        lm: the model.
        prepared: :class:`sur_lab.repair.PreparedEdit` (Dirty and Shift caches; not modified).
        supports: ``{label: Support}`` (label: a budget in % or any key), each with ``0 < B < S``.
        layers: layers to sample; heads: query heads to sample (the same in every layer).
        max_rows: refreshed positions evaluated per support (sampled with ``seed``; all when fewer).
        seed: row sampling seed.
        replay_capture: ``(cache_⋆, captured)`` from :func:`replay_with_queries` with the same layers and heads.
        progress: show a tqdm bar.

    Returns:
        DataFrame of :func:`bound_rows` with columns ``label, B, R`` prepended.

    Raises:
        ValueError: naming ``supports`` when one is empty or full (B = 0 or B = S leave nothing to bound), or
            ``replay_capture`` when it lacks a sampled layer.
    """
    edit = prepared.edit
    for label, sup in supports.items():
        if not 0 < sup.size < edit.suffix_len:
            raise ValueError(f"supports[{label!r}] has B={sup.size}; need 0 < B < S={edit.suffix_len}")
    if replay_capture is None:
        replay_capture = replay_with_queries(lm, prepared.dirty_cache, edit, layers, heads)
    cache_ref, q_ref = replay_capture
    missing = sorted(set(layers) - set(q_ref))
    if missing:
        raise ValueError(f"replay_capture lacks layers {missing}")
    frames = []
    for label, sup in tqdm(supports.items(), desc="supports", disable=not progress):
        cache_a, q_a = refresh_with_queries(lm, prepared.shift_cache, edit, sup, layers, heads)
        rows = sample_rows(sup.absolute(edit.prefix_len), max_rows, seed)
        frames.append(
            bound_rows(
                lm, cache_a, q_a, cache_ref, q_ref, rows, heads, prefix_len=edit.prefix_len,
                extra={"R": sup.num_intervals, "B": sup.size, "label": label},
            )
        )
    return pd.concat(frames, ignore_index=True)


# ---------------------------------------------------------------------------------------------------------------------
# Building the case


def theory_edit(
    tokenizer,
    source: str = "hotpotqa",
    *,
    example_index: int = 0,
    num_passages: int = 10,
    delete_at: int = 1,
    deletion_width: int = 1,
    haystack_passages: int = 0,
    seed: int = 0,
) -> tuple[EditedContext, Any]:
    """A real-context deletion edit for the theory notebook.

    The context is the example's supporting and distractor passages shuffled with ``seed`` (``source`` a development
    dataset key or file), or, for ``source="haystack"``, the HotpotQA example's supporting passages mixed with
    ``haystack_passages`` filler paragraphs from :func:`sur_lab.data.qa.load_corpus` chosen with ``seed``. The first
    ``num_passages`` of the shuffled list are kept and ``deletion_width`` consecutive passages starting at index
    ``delete_at`` are deleted (never the last passage, which would leave no suffix).

    Returns:
        ``(edit, example)``.

    Raises:
        TypeError: naming ``example_index``, ``num_passages``, ``haystack_passages``, ``delete_at``,
            ``deletion_width`` or ``seed`` when not an integer.
        ValueError: before any file is read, naming ``example_index``, ``haystack_passages``, ``delete_at`` or
            ``seed`` when negative, ``deletion_width`` when < 1, ``num_passages`` when < 2; then naming ``delete_at`` /
            ``deletion_width`` / ``num_passages`` when the deletion does not fit, ``example_index`` when past the
            last example (:func:`sur_lab.data.qa.load_example`), or ``source`` when it names a held-out
            split.
    """
    as_count(example_index, "example_index", minimum=0)
    as_count(num_passages, "num_passages", minimum=2)
    as_count(haystack_passages, "haystack_passages", minimum=0)
    as_count(delete_at, "delete_at", minimum=0)
    as_count(deletion_width, "deletion_width", minimum=1)
    as_count(seed, "seed", minimum=0)
    if is_held_out(source):  # by the data README's file names (and pinned checksums), not any path with "test"
        raise ValueError(f"source={source!r}: held-out test files are for final evaluation only")
    rng = np.random.default_rng(seed)
    if source == "haystack":
        example = load_example("hotpotqa", example_index)
        corpus = load_corpus()
        filler = [corpus[i] for i in rng.choice(len(corpus), size=haystack_passages, replace=False)]
        passages = list(example.supporting) + filler
    else:
        example = load_example(source, example_index)
        passages = list(example.supporting) + list(example.distractors)
    order = rng.permutation(len(passages))
    passages = [passages[i] for i in order][:num_passages]
    if delete_at + deletion_width > len(passages) or len(passages) < 2:
        raise ValueError(
            f"delete_at={delete_at}, deletion_width={deletion_width}: only {len(passages)} passages (num_passages)"
        )
    if delete_at + deletion_width == len(passages):
        raise ValueError(f"delete_at={delete_at} + deletion_width={deletion_width} deletes the last passage: no suffix")
    documents, spans = format_passages(passages)
    span = (spans[delete_at][0], spans[delete_at + deletion_width - 1][1])
    return chat_edit(tokenizer, documents, example.question, span), example


__all__ = [
    "AttentionCapture",
    "CapturedRows",
    "bound_rows",
    "bound_study",
    "evenly_spaced_layers",
    "kv_head_of",
    "refresh_with_queries",
    "replay_with_queries",
    "sample_rows",
    "theory_edit",
]
