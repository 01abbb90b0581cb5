"""SAFE-KV: repair units, selectors, protocols and endpoints for composed (non-prefix) KV caches.

A composed cache (:mod:`sur_lab.composition`) is repaired by re-encoding a *repair unit*, a set of document positions
expressed as a :class:`~sur_lab.budget.Support` over the ``S`` positions after the shared prefix, through the same
executor interface as deletion repair (``get_executor(name)(lm, composed, edit, support)``). Units (SAFE-KV section 1,
Figure 1, Table 27):

- ``doc``: the selected document(s) only (Fig. 1c);
- ``window``: the selected document and the next ``width - 1`` (w2–w4);
- ``suffix``: the causal suffix from the selected start document to the query (Fig. 1d, SAFE-KV's repair);
- ``adaptive``: that suffix trimmed at its start to the allowance ``B(S, b)`` of a budget b (Eq. 3), so it stays
  causally closed up to the query;
- ``linked``: the selected documents and the last document (the one the query reads last) as separate intervals,
  a "reasoning chain" of evidence linked to the query with stale gaps in between;
- ``sur``: SUR's budgeted allocator (Algorithm 1) over the composed documents, a further comparison;
- ``none`` (prefix composition, no repair) and ``full`` (full prefill, the reference).

Start candidates. A selector scores the n documents; ``K`` candidates are its top-K documents (earlier document first
among ties) and the start of windows, suffixes and adaptive suffixes is the earliest candidate ("K1", "K2").

Protocols: ``forward`` recomputes the support with an executor (actual forwarding); ``donor`` copies the support's rows
from the full-prefill cache, a diagnostic upper bound that needs the very cache repair avoids and that figures label
as such.

Endpoints (per request): answer preservation (the generated answer equals full prefill's after normalization,
:func:`answers_agree`), token exactness (identical generated ids), gold EM (:func:`sur_lab.scoring.score_example`),
changed-wrong (answer changed and gold-wrong), repair ratio ``B / S`` (fraction of the reused document context
re-encoded) and time to first logit (TTFL: compose + select + refresh + query forward, ms) against full prefill's
(forward of the S document tokens + query forward after the shared prefix). Operating rule: serve by full prefill when
no reuse path reaches the required preservation with a smaller TTFL.

Source: SAFE-KV (Zhang, 2026): abstract, Figures 1–5, Tables 20 and 27; SUR: section 3.2 and Algorithm 1 of the
budgeted KV-cache repair paper.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from transformers import DynamicCache

from .allocators import AllocationRequest, allocate
from .allocators.sur import token_relevance, unit_scores
from .answer import Answer
from .budget import Support, allowance, check_budget
from .cache_ops import cache_length, caches_equal, clone_cache, layer_deviation, slice_rows, to_tensors, write_rows_
from .composition import (
    ComposedPrompt,
    CompositionCaches,
    build_caches,
    compose_prompt,
    composition_edit,
    prefix_cache,
)
from .edits import EditedContext
from .executors import get_executor
from .forward import decode_step
from .models import LoadedModel
from .scoring import agreement, extract_answer, first_token_tv, normalize_answer
from .units import Unit, segment_units

UNITS = ("none", "doc", "window", "suffix", "adaptive", "linked", "sur", "full")
#: Units whose support depends on a selector's start candidates.
SELECTOR_UNITS = ("doc", "window", "suffix", "adaptive", "linked")
SELECTORS = ("risk", "query", "oracle")
PROTOCOLS = ("forward", "donor")
PROTOCOL_LABELS = {"forward": "actual forwarding", "donor": "donor-copy (diagnostic upper bound)"}
#: Token scores averaged into a document's query score (SUR's unit score, appendix 7.3).
QUERY_TOP_K = 4


# ---------------------------------------------------------------------------------------------------------------------
# Selectors


def risk_components(prompt: ComposedPrompt) -> tuple[np.ndarray, np.ndarray]:
    """The two factors of the risk score, each float64 ``[n]`` in [0, 1]; see :func:`risk_scores`."""
    lens = prompt.doc_lens.astype(np.float64)
    history = np.concatenate(([0.0], np.cumsum(lens)[:-1]))
    missing = history / (prompt.prefix_len + history)
    prefix_set = set(prompt.prefix_ids.tolist())
    coupling = np.zeros(prompt.num_docs)
    seen: set[int] = set()
    for i, ids in enumerate(prompt.doc_ids):
        toks = ids.tolist()
        if i > 0:
            coupling[i] = np.mean([t in seen and t not in prefix_set for t in toks])
        seen.update(toks)
    return missing, coupling


def risk_scores(prompt: ComposedPrompt) -> np.ndarray:
    """Risk-guided selector: a cheap, forward-free score of how far each document's composed state drifts.

    ``risk_i = missing_i * coupling_i`` where

    - ``missing_i = H_i / (p + H_i)``, ``H_i = sum_{j<i} L_j``: the fraction of document i's true history that its
      prefix-conditioned state never saw (0 for the first document, whose composed rows are exactly full prefill's);
    - ``coupling_i``: the fraction of document i's tokens whose id also occurs in an earlier document and not in the
      prefix. Shared tokens (repeated entities, titles, dates) are where cross-document attention (induction and copy
      heads) goes, so they are where the missing history changes the state most; CacheBlend makes the same
      observation for chunk fusion (tokens with high cross-chunk attention deviate most).

    Based only on token ids and lengths: O(S) set look-ups, no model forward, no access to the full-prefill cache.
    Validated against the measured per-document drift (:func:`document_drift`, :func:`drift_table`): on the embedded
    SmolLM2-135M with HotpotQA / 2Wiki development prompts of 4 and 16 documents, Spearman ρ is 0.58–0.85 per
    workload and 0.76 pooled (notebook 06). It predicts *how much* a document drifts, which grows with its position;
    it does not say where a causal suffix must start (the first drifted document is always document 1).

    Returns:
        float64 ``[n]``, higher = riskier; ranks break ties by earlier document.
    """
    missing, coupling = risk_components(prompt)
    return missing * coupling


@torch.inference_mode()
def query_scores(lm: LoadedModel, prompt: ComposedPrompt) -> np.ndarray:
    """Query-guided selector: each document's relevance to the question from frozen input embeddings.

    SUR's token relevance ``r_t = max_j cos(E(x_t), E(q_j)) + 0.25 * 1[x_t in q]`` (Eq. 7) over the document tokens,
    then the mean of each document's four highest token scores (SUR's unit score, appendix 7.3), documents as units.

    Returns:
        float64 ``[n]``.
    """
    embedding = lm.model.get_input_embeddings().weight
    device = embedding.device
    scores = token_relevance(embedding, prompt.suffix_ids.to(device), prompt.relevance_ids.to(device))
    units = [Unit(a, b, 0) for a, b in prompt.doc_bounds]
    return unit_scores(scores, units, QUERY_TOP_K)


def oracle_scores(prompt: ComposedPrompt) -> np.ndarray:
    """Oracle-evidence selector: 1 for gold supporting documents, 0 otherwise (float64 ``[n]``; a diagnostic).

    Raises:
        ValueError: naming ``prompt`` when no document is marked supporting.
    """
    flags = np.asarray(prompt.supporting, dtype=np.float64)
    if not flags.any():
        raise ValueError("prompt has no supporting documents; the oracle selector needs gold evidence labels")
    return flags


def selector_scores(selector: str, lm: LoadedModel | None, prompt: ComposedPrompt) -> np.ndarray:
    """Scores of ``selector`` (``"risk"``, ``"query"``, ``"oracle"``), float64 ``[n]``.

    Raises:
        ValueError: naming ``selector`` when unknown, ``lm`` when the query selector gets none.
    """
    if selector == "risk":
        return risk_scores(prompt)
    if selector == "query":
        if lm is None:
            raise ValueError("lm is required by the query selector (frozen input embeddings)")
        return query_scores(lm, prompt)
    if selector == "oracle":
        return oracle_scores(prompt)
    raise ValueError(f"selector={selector!r}; allowed: {', '.join(SELECTORS)}")


def rank_documents(scores) -> np.ndarray:
    """Document indices by decreasing score, earlier document first among ties (int64 ``[n]``)."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    return np.lexsort((np.arange(len(s)), -s)).astype(np.int64)


def start_candidates(scores, k: int) -> np.ndarray:
    """The top-``k`` documents by score, returned in document order (int64 ``[k]``); the start is the first.

    Raises:
        ValueError: naming ``k`` when it is not in ``[1, n]``.
    """
    n = len(np.asarray(scores).reshape(-1))
    if int(k) != k or not 1 <= k <= n:
        raise ValueError(f"k={k!r} must be an integer in [1, {n}] (number of documents)")
    return np.sort(rank_documents(scores)[: int(k)])


# ---------------------------------------------------------------------------------------------------------------------
# Repair units as supports


def _positions(prompt: ComposedPrompt, docs) -> np.ndarray:
    bounds = prompt.doc_bounds
    parts = [np.arange(*bounds[d], dtype=np.int64) for d in sorted(set(int(d) for d in docs))]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def document_support(prompt: ComposedPrompt, docs: Sequence[int]) -> Support:
    """Document-only repair: every position of the given documents (Fig. 1c).

    Raises:
        ValueError: naming ``docs`` when an index is outside ``[0, n)``.
    """
    for d in docs:
        prompt.check_doc(d, "docs")
    return Support(_positions(prompt, docs), prompt.suffix_len)


def window_support(prompt: ComposedPrompt, start: int, width: int) -> Support:
    """Fixed downstream window: documents ``start .. start + width - 1`` (clipped at the last document).

    Raises:
        ValueError: naming ``start`` (outside ``[0, n)``) or ``width`` (< 1).
    """
    start = prompt.check_doc(start)
    if int(width) != width or width < 1:
        raise ValueError(f"width={width!r} must be an integer >= 1 (documents)")
    return Support(_positions(prompt, range(start, min(start + int(width), prompt.num_docs))), prompt.suffix_len)


def suffix_support(prompt: ComposedPrompt, start: int) -> Support:
    """Causal suffix repair: every position from document ``start`` to the query (Fig. 1d).

    Raises:
        ValueError: naming ``start`` when it is outside ``[0, n)``.
    """
    start = prompt.check_doc(start)
    a = int(prompt.doc_starts[start])
    return Support(np.arange(a, prompt.suffix_len, dtype=np.int64), prompt.suffix_len)


def adaptive_suffix_support(prompt: ComposedPrompt, start: int, budget_pct: float) -> Support:
    """Adaptive suffix: the causal suffix from ``start`` trimmed at its start to the allowance ``B(S, b)`` (Eq. 3).

    Positions ``[max(start_pos, S - B), S)``: the repaired region always ends at the query, so no repaired row is
    followed by a stale one; trimming leaves the beginning of the selected region stale.

    Raises:
        ValueError: naming ``start`` (outside ``[0, n)``) or ``budget_pct`` (outside [0, 100]).
    """
    start = prompt.check_doc(start)
    b = check_budget(budget_pct)
    S = prompt.suffix_len
    a = max(int(prompt.doc_starts[start]), S - allowance(S, b))
    return Support(np.arange(a, S, dtype=np.int64), S)


def linked_support(prompt: ComposedPrompt, docs: Sequence[int]) -> Support:
    """Linked intervals: the given documents and the last document (the query's neighbour), each an interval.

    The executor recomputes them in order, so each later interval sees the repaired earlier ones; the documents in the
    gaps keep their composed (stale) states.

    Raises:
        ValueError: naming ``docs`` when an index is outside ``[0, n)``.
    """
    for d in docs:
        prompt.check_doc(d, "docs")
    return Support(_positions(prompt, [*docs, prompt.num_docs - 1]), prompt.suffix_len)


def repair_ratio(support: Support) -> float:
    """Fraction of the reused document context re-encoded: ``B / S`` (0 when S = 0)."""
    return support.size / support.suffix_len if support.suffix_len else 0.0


@dataclass(frozen=True)
class RepairSpec:
    """One repair configuration.

    Attributes:
        unit: one of :data:`UNITS`.
        selector: one of :data:`SELECTORS` (used by :data:`SELECTOR_UNITS`; ignored otherwise).
        k: start candidates (K1, K2, ...), >= 1.
        width: documents per window (``unit="window"``; w2–w4), >= 1.
        budget_pct: budget b in [0, 100] (``"adaptive"`` and ``"sur"``), percent of S.

    Raises:
        ValueError: naming ``unit``, ``selector``, ``k``, ``width`` or ``budget_pct`` when invalid.
    """

    unit: str
    selector: str = "risk"
    k: int = 1
    width: int = 2
    budget_pct: float | None = None

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"unit={self.unit!r}; allowed: {', '.join(UNITS)}")
        if self.selector not in SELECTORS:
            raise ValueError(f"selector={self.selector!r}; allowed: {', '.join(SELECTORS)}")
        if int(self.k) != self.k or self.k < 1:
            raise ValueError(f"k={self.k!r} must be an integer >= 1")
        if int(self.width) != self.width or self.width < 1:
            raise ValueError(f"width={self.width!r} must be an integer >= 1")
        if self.unit in ("adaptive", "sur"):
            if self.budget_pct is None:
                raise ValueError(f"budget_pct is required for unit={self.unit!r} (percent in [0, 100])")
            object.__setattr__(self, "budget_pct", check_budget(self.budget_pct))

    @property
    def method(self) -> str:
        """The unit's name without the selector, e.g. ``"Suffix K2"``, ``"w3 K1"``, ``"SUR 50%"``."""
        names = {
            "none": "Prefix composition",
            "full": "Full prefill",
            "doc": f"Doc K{self.k}",
            "window": f"w{self.width} K{self.k}",
            "suffix": f"Suffix K{self.k}",
            "linked": f"Linked K{self.k}",
        }
        if self.unit == "adaptive":
            return f"Adaptive K{self.k} {self.budget_pct:g}%"
        if self.unit == "sur":
            return f"SUR {self.budget_pct:g}%"
        return names[self.unit]

    @property
    def uses_selector(self) -> bool:
        return self.unit in SELECTOR_UNITS

    @property
    def label(self) -> str:
        """Method plus selector where one is used, e.g. ``"Suffix K2 · risk"``."""
        return f"{self.method} · {self.selector}" if self.uses_selector else self.method


def support_for(spec: RepairSpec, prompt: ComposedPrompt, scores=None) -> tuple[Support, int | None, tuple[int, ...]]:
    """The support of a selector-based or reference unit.

    Args:
        spec: the configuration (not ``"sur"``, which needs the allocator: see :func:`plan_repair`).
        prompt: the composed prompt.
        scores: the selector's document scores ``[n]`` (required by selector units).

    Returns:
        ``(support, start_document_or_None, candidate_documents)``.

    Raises:
        ValueError: naming ``spec`` for ``"sur"``, ``scores`` when missing or of the wrong length, ``k`` when larger
            than n.
    """
    S = prompt.suffix_len
    if spec.unit == "none":
        return Support(np.zeros(0, dtype=np.int64), S), None, ()
    if spec.unit == "full":
        return Support.full(S), 0, ()
    if spec.unit == "sur":
        raise ValueError("spec.unit='sur' is planned by the SUR allocator; use plan_repair")
    if scores is None or len(scores) != prompt.num_docs:
        raise ValueError(f"scores must hold one score per document ({prompt.num_docs})")
    cands = start_candidates(scores, spec.k)
    start = int(cands[0])
    docs = tuple(int(c) for c in cands)
    if spec.unit == "doc":
        return document_support(prompt, docs), start, docs
    if spec.unit == "window":
        return window_support(prompt, start, spec.width), start, docs
    if spec.unit == "suffix":
        return suffix_support(prompt, start), start, docs
    if spec.unit == "adaptive":
        return adaptive_suffix_support(prompt, start, spec.budget_pct), start, docs
    return linked_support(prompt, docs), start, docs


@dataclass(frozen=True)
class RepairPlan:
    """A repair configuration resolved on one prompt.

    Attributes:
        spec: the configuration.
        support: positions after the prefix to re-encode (``[B]``, suffix-local).
        start_doc: first repaired document of a selector unit (``None`` otherwise).
        candidates: the selector's start candidates (document indices).
        select_ms: selection time, ms (selector scoring or SUR allocation).
    """

    spec: RepairSpec
    support: Support
    start_doc: int | None = None
    candidates: tuple[int, ...] = ()
    select_ms: float = 0.0

    @property
    def ratio(self) -> float:
        return repair_ratio(self.support)


def plan_repair(spec: RepairSpec, prompt: ComposedPrompt, *, scores: dict[str, np.ndarray] | None = None,
                select_ms: dict[str, float] | None = None, lm: LoadedModel | None = None,
                edit: EditedContext | None = None, composed: DynamicCache | None = None,
                units: list[Unit] | None = None) -> RepairPlan:
    """Resolve ``spec`` on ``prompt``: selector units from precomputed ``scores[selector]``, SUR via its allocator.

    Args:
        spec: the configuration.
        prompt: the composed prompt.
        scores: selector name -> document scores ``[n]`` (computed here when missing).
        select_ms: selector name -> scoring time, ms (added to the plan's ``select_ms``).
        lm, edit, composed, units: SUR's request: model, :func:`composition_edit` of the prompt, the composed cache and
            optional precomputed semantic units.

    Raises:
        ValueError: see :func:`support_for`; naming ``lm`` when SUR or the query selector lacks it.
    """
    if spec.unit == "sur":
        if lm is None:
            raise ValueError("lm is required to plan SUR")
        edit = edit if edit is not None else composition_edit(prompt)
        request = AllocationRequest(lm, edit, spec.budget_pct, shift_cache=composed, units=units)
        selection = allocate("SUR", request)
        return RepairPlan(spec, selection.support, None, (), selection.select_ms)
    ms = 0.0
    doc_scores = None
    if spec.uses_selector:
        scores = scores if scores is not None else {}
        if spec.selector not in scores:
            t0 = time.perf_counter()
            scores[spec.selector] = selector_scores(spec.selector, lm, prompt)
            ms = (time.perf_counter() - t0) * 1e3
        else:
            ms = (select_ms or {}).get(spec.selector, 0.0)
        doc_scores = scores[spec.selector]
    t0 = time.perf_counter()
    support, start, docs = support_for(spec, prompt, doc_scores)
    return RepairPlan(spec, support, start, docs, ms + (time.perf_counter() - t0) * 1e3)


# ---------------------------------------------------------------------------------------------------------------------
# Protocols


def donor_copy(composed: DynamicCache, full: DynamicCache, prefix_len: int, support: Support) -> DynamicCache:
    """Donor-copy protocol: the composed cache with the support's rows copied from the full-prefill cache.

    A diagnostic upper bound for a repair unit (it reads the cache that repair is meant to avoid computing).

    Args:
        composed: composed cache (``p + S`` rows); not modified.
        full: full-prefill cache (``p + S`` rows); not modified.
        prefix_len: p.
        support: suffix-local positions to copy.

    Returns:
        A new cache of ``p + S`` rows.

    Raises:
        ValueError: naming ``full`` when the two caches differ in length, ``support`` when its length is not S.
    """
    n = cache_length(composed)
    if cache_length(full) != n:
        raise ValueError(f"full has {cache_length(full)} rows; composed has {n}")
    if support.suffix_len != n - prefix_len:
        raise ValueError(f"support.suffix_len={support.suffix_len}; the composed suffix has {n - prefix_len} rows")
    out = clone_cache(composed)
    donor = to_tensors(full)
    for a, b in support.intervals:
        lo, hi = prefix_len + a, prefix_len + b
        write_rows_(out, lo, [(k[:, :, lo:hi], v[:, :, lo:hi]) for k, v in donor])
    return out


def run_protocol(lm: LoadedModel, caches: CompositionCaches, edit: EditedContext, support: Support,
                 protocol: str = "forward", executor: str = "sequential") -> tuple[DynamicCache, float]:
    """Apply a support to the composed cache with one protocol; returns ``(cache, ms)``.

    ``"forward"`` runs ``get_executor(executor)(lm, caches.composed, edit, support)`` (the deletion executors'
    interface; ``edit`` is :func:`composition_edit` of the prompt); ``"donor"`` runs :func:`donor_copy`. An empty
    support returns a clone of the composed cache (0 ms). Inputs are not modified.

    Raises:
        ValueError: naming ``protocol`` or ``executor`` when unknown (before any work).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r}; allowed: {', '.join(PROTOCOLS)}")
    run = get_executor(executor)
    if support.size == 0:
        return clone_cache(caches.composed), 0.0
    t0 = time.perf_counter()
    if protocol == "forward":
        cache = run(lm, caches.composed, edit, support)
    else:
        cache = donor_copy(caches.composed, caches.full, edit.prefix_len, support)
    return cache, (time.perf_counter() - t0) * 1e3


# ---------------------------------------------------------------------------------------------------------------------
# Answers


def answers_agree(text: str, reference: str) -> bool:
    """Answer preservation: the two generated answers are equal after :func:`sur_lab.scoring.normalize_answer`.

    The whole greedy continuation (up to ``max_new_tokens``) is compared, not only its first line: a small model often
    opens with a lead-in line ("The answer to this question is:") whose first-line extraction would call any two
    answers with the same lead-in preserved. (``extracted_agree`` in the records keeps the extracted-answer rule.)
    """
    return normalize_answer(" ".join(text.split())) == normalize_answer(" ".join(reference.split()))


@torch.inference_mode()
def _forward_keep(lm: LoadedModel, ids: torch.Tensor, cache: DynamicCache, keep: int) -> torch.Tensor:
    """:func:`sur_lab.forward.forward_tokens` keeping the last ``keep`` positions' logits (float32 ``[keep, V]``)."""
    start = cache_length(cache)
    positions = torch.arange(start, start + ids.numel(), device=lm.device)
    out = lm.model(input_ids=ids.to(lm.device)[None], cache=cache, position_ids=positions[None], use_cache=True,
                   logits_to_keep=int(keep))
    return out.logits[0].float()


@torch.inference_mode()
def greedy_answer(lm: LoadedModel, cache: DynamicCache, query_ids: torch.Tensor, *, max_new_tokens: int,
                  draft: Sequence[int] = ()) -> Answer:
    """Greedy answer from ``cache`` (the stopping rule of :func:`sur_lab.answer.answer`), optionally verifying a draft.

    Without a draft: the query is forwarded (its time is ``timings_ms["query"]``, the first logit) and the answer is
    decoded step by step. With a draft (full prefill's answer tokens), the query and the draft are forwarded together
    and the draft tokens are accepted while each is the argmax of the previous position's logits; at the first
    divergence the draft rows are dropped and decoding continues step by step. The result is the plain greedy decode
    up to float reassociation between a multi-token and a one-token forward; a preserved answer costs one forward
    instead of one per token (decode steps dominate CPU evaluation time). ``timings_ms["query"]`` then includes the
    draft tokens, so time to first logit should use a draft-free query forward.

    Args:
        lm: the model.
        cache: pre-query cache; not modified (decoding runs on a clone).
        query_ids: ``[Q]`` int64.
        max_new_tokens: decoding limit, tokens (>= 1).
        draft: token ids to verify (e.g. the reference answer's ``token_ids``).

    Returns:
        Answer with ``timings_ms`` ``query``, ``decode`` and ``answer`` (ms).

    Raises:
        ValueError: if ``max_new_tokens`` < 1.
    """
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
    work = clone_cache(cache)
    eos = set(lm.eos_token_ids)
    draft = [int(t) for t in draft][: int(max_new_tokens)]
    base = cache_length(work) + int(query_ids.numel())
    t0 = time.perf_counter()
    ids = torch.cat((query_ids.reshape(-1), torch.tensor(draft, dtype=torch.long))) if draft else query_ids
    logits = _forward_keep(lm, ids, work, len(draft) + 1)  # [m + 1, V]: after the query, then after each draft token
    t1 = time.perf_counter()
    first = logits[0].detach().cpu().clone()
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
    return Answer(text, tuple(generated), first, finished,
                  {"query": (t1 - t0) * 1e3, "decode": (t2 - t1) * 1e3, "answer": (t2 - t0) * 1e3})


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation of one prompt


def document_drift(prompt: ComposedPrompt, cache: DynamicCache, full: DynamicCache) -> np.ndarray:
    """Measured drift of each document's rows, ``||KV_cache - KV_full|| / ||KV_full||`` over all layers (``[n]`` f64).

    Raises:
        ValueError: naming ``cache`` when its length differs from ``full``'s.
    """
    if cache_length(cache) != cache_length(full):
        raise ValueError(f"cache has {cache_length(cache)} rows; full has {cache_length(full)}")
    rows = slice(prompt.prefix_len, prompt.prefix_len + prompt.suffix_len)
    dev = layer_deviation(cache, full, rows).sum(dim=0).numpy()  # [S]
    norm = np.zeros(prompt.suffix_len)
    for k, v in to_tensors(full):
        norm += (k[0, :, rows].double().pow(2).sum(dim=(0, 2)) + v[0, :, rows].double().pow(2).sum(dim=(0, 2))).numpy()
    idx = prompt.doc_index
    num = np.bincount(idx, weights=dev, minlength=prompt.num_docs)
    den = np.bincount(idx, weights=norm, minlength=prompt.num_docs)
    return np.sqrt(num / den)


def default_specs(budgets: Sequence[float] = (50,)) -> list[RepairSpec]:
    """The SAFE-KV comparison used by the notebook.

    Prefix composition; risk-guided Doc K1, windows w2–w4 and Suffix K1 from the K1 start (Figure 2), Suffix K2 and
    Adaptive K2 at ``budgets``; query-guided Suffix K2; oracle evidence Doc K2 (the gold documents),
    Linked K2 and Suffix K1; SUR at ``budgets``.

    Raises:
        ValueError: naming ``budget_pct`` for a budget outside [0, 100].
    """
    specs = [RepairSpec("none"), RepairSpec("doc", "risk", 1)]
    specs += [RepairSpec("window", "risk", 1, width=w) for w in (2, 3, 4)]
    specs += [RepairSpec("suffix", "risk", 1), RepairSpec("suffix", "risk", 2)]
    specs += [RepairSpec("adaptive", "risk", 2, budget_pct=b) for b in budgets]
    specs += [RepairSpec("suffix", "query", 2)]
    specs += [RepairSpec("doc", "oracle", 2), RepairSpec("linked", "oracle", 2), RepairSpec("suffix", "oracle", 1)]
    specs += [RepairSpec("sur", budget_pct=b) for b in budgets]
    return specs


def sweep_specs() -> list[RepairSpec]:
    """The evidence position sweep (Figure 3): prefix composition, oracle Doc K2 (the gold documents) and oracle
    Suffix K1 (from the first gold document)."""
    return [RepairSpec("none"), RepairSpec("doc", "oracle", 2), RepairSpec("suffix", "oracle", 1)]


def evaluate_prompt(lm: LoadedModel, prompt: ComposedPrompt, specs: Sequence[RepairSpec], *,
                    protocols: Sequence[str] = ("forward",), executor: str = "sequential", max_new_tokens: int = 16,
                    scorer: Callable[[str], bool] | None = None, prefix_kv: DynamicCache | None = None,
                    doc_store: dict | None = None, caches: CompositionCaches | None = None,
                    keep_drift: bool = False) -> list[dict[str, Any]]:
    """Compose, repair with every spec and protocol, answer, and score against full prefill and the gold answer.

    Identical (protocol, support) pairs are computed once and their records share results (e.g. a K2 suffix that
    starts where the K1 suffix does); a repaired cache bitwise equal to full prefill's reuses its answer.

    Args:
        lm: the model.
        prompt: the composed prompt.
        specs: repair configurations (a ``"full"`` row is always emitted first).
        protocols: subset of :data:`PROTOCOLS`.
        executor: registered executor name for the forward protocol.
        max_new_tokens: decoding limit, tokens.
        scorer: ``fn(extracted_answer) -> bool`` gold-EM rule (``em`` is ``None`` without one).
        prefix_kv: shared cache of the prefix (prefilled when ``None``).
        doc_store: optional dict ``tuple(doc ids) -> document cache`` reused across prompts (a document cache store;
            filled here). Its encoding time is offline and not part of any TTFL.
        caches: precomputed caches (skips building them).
        keep_drift: add the measured per-document drift of the composed cache (``drift``, list, see
            :func:`document_drift`) and the risk scores (``risk``, list) to each record.

    Returns:
        One record per (spec, protocol) with: ``method``, ``selector``, ``label``, ``unit``, ``k``, ``width``,
        ``budget_pct``, ``protocol``, ``start_doc``, ``candidates``, ``num_docs``, ``allowance`` (B), ``suffix_len``
        (S), ``repair_ratio``, ``num_intervals``, ``compose_ms``, ``select_ms``, ``refresh_ms``, ``query_ms``,
        ``ttfl_ms``, ``full_ttfl_ms``, ``answer``, ``prediction`` (extracted), ``full_prediction``, ``preserved``
        (:func:`answers_agree` with full prefill's answer), ``extracted_agree`` (extracted answers agree),
        ``token_exact``, ``em``, ``full_em``, ``changed_wrong``, ``tv_full`` (first-token total variation) and
        ``gold_docs`` (indices of supporting documents). Times in ms; ``query_ms`` is full prefill's draft-free query
        forward, shared by every path (the query costs the same on any ``p + S`` row cache).

    Raises:
        ValueError: naming ``protocols`` or ``executor`` when unknown, before any model call.
    """
    for proto in protocols:
        if proto not in PROTOCOLS:
            raise ValueError(f"protocols contains {proto!r}; allowed: {', '.join(PROTOCOLS)}")
    get_executor(executor)
    edit = composition_edit(prompt)
    if caches is None:
        caches = build_caches(lm, prompt, prefix_kv, doc_store)
    reference = greedy_answer(lm, caches.full, edit.query_ids, max_new_tokens=max_new_tokens)
    ref_pred = extract_answer(reference.text)
    full_em = bool(scorer(ref_pred)) if scorer is not None else None
    query_ms = reference.timings_ms["query"]
    full_ttfl = caches.timings_ms["full"] + query_ms
    compose_ms = caches.timings_ms["compose"]
    gold_docs = [i for i, s in enumerate(prompt.supporting) if s]

    scores: dict[str, np.ndarray] = {}
    score_ms: dict[str, float] = {}
    for sel in sorted({s.selector for s in specs if s.uses_selector}):
        t0 = time.perf_counter()
        scores[sel] = selector_scores(sel, lm, prompt)
        score_ms[sel] = (time.perf_counter() - t0) * 1e3
    units = segment_units(edit) if any(s.unit == "sur" for s in specs) else None
    drift = document_drift(prompt, caches.composed, caches.full).tolist() if keep_drift else None

    def record(spec: RepairSpec, plan: RepairPlan, protocol: str, ans: Answer, refresh_ms: float) -> dict[str, Any]:
        pred = extract_answer(ans.text)
        em = bool(scorer(pred)) if scorer is not None else None
        preserved = answers_agree(ans.text, reference.text)
        if spec.unit == "full":
            ttfl = full_ttfl
        else:
            # The query forward costs the same on every p + S row cache: full prefill's draft-free query time.
            ttfl = compose_ms + plan.select_ms + refresh_ms + query_ms
        rec = {
            "method": spec.method, "selector": spec.selector if spec.uses_selector else "", "label": spec.label,
            "unit": spec.unit, "k": spec.k, "width": spec.width if spec.unit == "window" else np.nan,
            "budget_pct": spec.budget_pct if spec.budget_pct is not None else np.nan, "protocol": protocol,
            "start_doc": plan.start_doc if plan.start_doc is not None else -1, "candidates": list(plan.candidates),
            "num_docs": prompt.num_docs, "allowance": plan.support.size, "suffix_len": prompt.suffix_len,
            "repair_ratio": plan.ratio, "num_intervals": plan.support.num_intervals,
            "compose_ms": 0.0 if spec.unit == "full" else compose_ms, "select_ms": plan.select_ms,
            "refresh_ms": caches.timings_ms["full"] if spec.unit == "full" else refresh_ms,
            "query_ms": query_ms, "ttfl_ms": ttfl, "full_ttfl_ms": full_ttfl,
            "answer": ans.text, "prediction": pred, "full_prediction": ref_pred, "preserved": preserved,
            "extracted_agree": bool(agreement(pred, ref_pred)),
            "token_exact": tuple(ans.token_ids) == tuple(reference.token_ids), "em": em, "full_em": full_em,
            "changed_wrong": (not preserved and em is False) if em is not None else None,
            "tv_full": first_token_tv(ans.first_token_logits, reference.first_token_logits),
            "gold_docs": gold_docs,
        }
        if drift is not None:
            rec["drift"] = drift
            rec["risk"] = risk_scores(prompt).tolist()
        return rec

    full_spec = RepairSpec("full")
    full_plan = RepairPlan(full_spec, Support.full(prompt.suffix_len), 0)
    records = [record(full_spec, full_plan, protocols[0], reference, 0.0)]
    done: dict[tuple, tuple[Answer, float]] = {}
    for spec in specs:
        if spec.unit == "full":
            continue
        plan = plan_repair(spec, prompt, scores=scores, select_ms=score_ms, lm=lm, edit=edit,
                           composed=caches.composed, units=units)
        for protocol in protocols:
            # Every protocol leaves an empty support as the composed cache, so they share one result.
            key = ("none",) if plan.support.size == 0 else (protocol, plan.support.positions.tobytes())
            if key not in done:
                cache, ms = run_protocol(lm, caches, edit, plan.support, protocol, executor)
                if caches_equal(cache, caches.full):
                    ans = reference
                else:
                    ans = greedy_answer(lm, cache, edit.query_ids, max_new_tokens=max_new_tokens,
                                        draft=reference.token_ids)
                done[key] = (ans, ms)
            ans, ms = done[key]
            records.append(record(spec, plan, protocol, ans, ms))
    return records


# ---------------------------------------------------------------------------------------------------------------------
# Building RAG prompts from QA examples


def _example_rng(example_id: str, seed: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(str(example_id).encode())])


def rag_passages(example, num_docs: int, *, seed: int = 0, filler: Sequence = ()) -> list:
    """The n passages of one RAG request: all gold passages, the example's own distractors, then filler passages.

    Filler (other questions' paragraphs, whose titles differ from this example's) pads to ``num_docs`` when the
    example's own passages run out (a Noise16 analogue). The order is a seeded permutation per example.

    Args:
        example: a :class:`~sur_lab.datasets.QAExample`.
        num_docs: n, documents in the prompt (>= number of gold passages).
        seed: order and filler seed (combined with the example id).
        filler: candidate padding passages.

    Returns:
        ``num_docs`` passages (``is_supporting`` marks gold ones).

    Raises:
        ValueError: naming ``num_docs`` when it is smaller than the gold count or cannot be reached with the filler.
    """
    gold = list(example.supporting)
    if num_docs < len(gold):
        raise ValueError(f"num_docs={num_docs} is smaller than the {len(gold)} gold passages of {example.id!r}")
    rng = _example_rng(example.id, seed)
    own = list(example.distractors)[: num_docs - len(gold)]
    need = num_docs - len(gold) - len(own)
    titles = {p.title for p in gold + list(example.distractors)}
    pool = [p for p in filler if p.title not in titles]
    if need > len(pool):
        raise ValueError(f"num_docs={num_docs}: only {len(pool)} filler passages for {need} missing documents")
    pad = [pool[int(i)] for i in rng.choice(len(pool), size=need, replace=False)] if need else []
    passages = gold + own + pad
    return [passages[int(i)] for i in rng.permutation(len(passages))]


@dataclass(frozen=True)
class RagRequest:
    """One composed request with what its records carry.

    Attributes:
        prompt: the composed prompt.
        meta: columns added to every record (e.g. ``dataset``, ``source_id``, ``num_docs``, ``slot``).
        scorer: gold-EM rule ``fn(extracted_answer) -> bool`` or ``None``.
    """

    prompt: ComposedPrompt
    meta: dict[str, Any] = field(default_factory=dict)
    scorer: Callable[[str], bool] | None = None


def build_request(tokenizer, example, num_docs: int, *, seed: int = 0, filler: Sequence = (),
                  max_doc_tokens: int | None = None, slot: int | None = None) -> RagRequest:
    """A :class:`RagRequest` for one QA example: :func:`rag_passages`, optionally :func:`place_evidence` at ``slot``,
    then :func:`sur_lab.composition.compose_prompt`; gold EM by :func:`sur_lab.scoring.score_example`.

    Raises:
        ValueError: see :func:`rag_passages`, :func:`place_evidence` and :func:`compose_prompt`.
    """
    from .scoring import score_example

    passages = rag_passages(example, num_docs, seed=seed, filler=filler)
    if slot is not None:
        passages = place_evidence(passages, slot)
    prompt = compose_prompt(tokenizer, passages, example.question, max_doc_tokens=max_doc_tokens)
    meta = {"dataset": example.dataset, "source_id": example.id, "num_docs": num_docs,
            "slot": -1 if slot is None else int(slot)}
    return RagRequest(prompt, meta, lambda pred, ex=example: score_example(pred, ex))


def run_requests(lm: LoadedModel, requests: Sequence[RagRequest], specs: Sequence[RepairSpec], *,
                 protocols: Sequence[str] = ("forward",), executor: str = "sequential", max_new_tokens: int = 16,
                 keep_drift: bool = False, progress: bool = True, desc: str = "requests") -> pd.DataFrame:
    """Run :func:`evaluate_prompt` over requests and return one long DataFrame (records plus ``meta`` columns).

    The prefix cache is shared by every request with the same prefix ids; document caches are kept in a store while
    consecutive requests share a ``meta["source_id"]`` (e.g. the same example at several evidence slots or document
    counts) and dropped when it changes, which bounds memory.

    Raises:
        ValueError: as :func:`evaluate_prompt`, before any model call.
    """
    from tqdm.auto import tqdm

    prefixes: dict[tuple[int, ...], DynamicCache] = {}
    store: dict = {}
    source = object()
    rows: list[dict[str, Any]] = []
    for req in tqdm(requests, desc=desc, disable=not progress):
        key = tuple(req.prompt.prefix_ids.tolist())
        if key not in prefixes:
            prefixes[key] = prefix_cache(lm, req.prompt)
        if req.meta.get("source_id", None) != source:
            store = {}
            source = req.meta.get("source_id", None)
        recs = evaluate_prompt(lm, req.prompt, specs, protocols=protocols, executor=executor,
                               max_new_tokens=max_new_tokens, scorer=req.scorer, prefix_kv=prefixes[key],
                               doc_store=store, keep_drift=keep_drift)
        rows.extend({**req.meta, **r} for r in recs)
    return pd.DataFrame(rows)


def place_evidence(passages: Sequence, slot: int) -> list:
    """Move the gold passages (as one block, in their current order) to start at document ``slot``.

    Raises:
        ValueError: naming ``slot`` when the block does not fit (``slot + gold > n``) or ``passages`` has no gold.
    """
    gold = [p for p in passages if getattr(p, "is_supporting", False)]
    rest = [p for p in passages if not getattr(p, "is_supporting", False)]
    if not gold:
        raise ValueError("passages has no supporting passage to place")
    if int(slot) != slot or not 0 <= slot <= len(passages) - len(gold):
        raise ValueError(f"slot={slot!r} must lie in [0, {len(passages) - len(gold)}] for {len(gold)} gold passages")
    return rest[:slot] + gold + rest[slot:]


DATASET_NAMES = {"hotpotqa": "HotpotQA", "2wikimultihopqa": "2Wiki", "musique": "MuSiQue", "iirc": "IIRC"}


def workload_name(dataset: str, num_docs: int) -> str:
    """Display name of a workload, e.g. ``"2Wiki·16"``."""
    return f"{DATASET_NAMES.get(dataset, dataset)}·{int(num_docs)}"


def drift_table(runs: pd.DataFrame, by: str = "workload") -> pd.DataFrame:
    """Measured drift of the composed cache and its rank agreement with the risk score, per ``by`` group.

    Uses one record per request (the full-prefill row) of :func:`run_requests` with ``keep_drift=True``; documents
    after the first are pooled (the first document's drift is exactly 0 and its risk 0).

    Returns:
        DataFrame with ``by``, ``requests``, ``docs``, ``mean_drift`` (relative K/V deviation), ``spearman_rho``
        (risk vs drift, pooled) and ``within_request_rho`` (mean per-request Spearman over requests with >= 4
        documents).

    Raises:
        ValueError: naming ``runs`` when it has no ``drift``/``risk`` columns.
    """
    from scipy.stats import spearmanr

    if "drift" not in runs.columns or "risk" not in runs.columns:
        raise ValueError("runs has no drift/risk columns; run with keep_drift=True")
    full = runs[runs["unit"] == "full"]
    rows = []
    for key, g in full.groupby(by, sort=False):
        drift = np.concatenate([np.asarray(d)[1:] for d in g["drift"]])
        risk = np.concatenate([np.asarray(r)[1:] for r in g["risk"]])
        within = [spearmanr(np.asarray(r)[1:], np.asarray(d)[1:])[0]
                  for r, d in zip(g["risk"], g["drift"]) if len(d) >= 4]
        rows.append({by: key, "requests": len(g), "docs": len(drift), "mean_drift": float(drift.mean()),
                     "spearman_rho": float(spearmanr(risk, drift)[0]) if len(drift) > 2 else np.nan,
                     "within_request_rho": float(np.nanmean(within)) if within else np.nan})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------------------
# Endpoints


def bootstrap_ci(values, *, confidence: float = 0.95, n_resamples: int = 9999, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (``scipy.stats.bootstrap``, ``method="percentile"``).

    A constant sample returns ``(value, value)`` (every resample has the same mean; scipy reports it as degenerate).

    Args:
        values: 1-D numbers or bools (e.g. per-request preservation).
        confidence: coverage in (0, 1).
        n_resamples: resamples, >= 1.
        seed: generator seed.

    Returns:
        ``(low, high)`` in the values' units.

    Raises:
        ValueError: naming ``values`` when empty or non-finite, ``confidence`` outside (0, 1).
    """
    from scipy.stats import bootstrap

    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("values is empty")
    if not np.all(np.isfinite(x)):
        raise ValueError("values must be finite")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must lie in (0, 1)")
    if np.all(x == x[0]):
        return float(x[0]), float(x[0])
    res = bootstrap((x,), np.mean, confidence_level=confidence, n_resamples=int(n_resamples), method="percentile",
                    vectorized=True, rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def summarize(df: pd.DataFrame, by: Sequence[str] = ("dataset", "num_docs", "label", "protocol"), *,
              confidence: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """Per-group endpoints of :func:`evaluate_prompt` records.

    Columns: ``by`` plus ``method``, ``selector``, ``unit``, ``n`` (requests), ``preservation`` (mean) with
    ``ci_low``/``ci_high`` (:func:`bootstrap_ci`), ``token_exact`` (mean), ``gold_em`` (mean, NaN without a
    scorer), ``changed_wrong`` (count), ``repair_ratio`` (mean), ``ttfl_ms`` and ``full_ttfl_ms`` (medians),
    ``speedup`` (``full_ttfl_ms / ttfl_ms`` of the medians) and the per-request speed-up's geometric mean
    ``speedup_gmean`` with its bootstrap interval ``speedup_ci_low``/``speedup_ci_high`` (paired: each request's
    full-prefill TTFL over its reuse TTFL).

    Raises:
        ValueError: naming ``by`` when a column is missing.
    """
    missing = [c for c in by if c not in df.columns]
    if missing:
        raise ValueError(f"by={tuple(by)!r}: {missing} are not columns of df")
    rows = []
    for key, g in df.groupby(list(by), sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        low, high = bootstrap_ci(g["preserved"].astype(float), confidence=confidence, seed=seed)
        em = g["em"].dropna()
        cw = g["changed_wrong"].dropna()
        row = dict(zip(by, key))
        row.update({
            "method": g["method"].iloc[0], "selector": g["selector"].iloc[0], "unit": g["unit"].iloc[0],
            "n": len(g), "preservation": float(g["preserved"].mean()), "ci_low": low, "ci_high": high,
            "token_exact": float(g["token_exact"].mean()),
            "gold_em": float(em.astype(float).mean()) if len(em) else np.nan,
            "changed_wrong": int(cw.astype(bool).sum()), "repair_ratio": float(g["repair_ratio"].mean()),
            "ttfl_ms": float(g["ttfl_ms"].median()), "full_ttfl_ms": float(g["full_ttfl_ms"].median()),
        })
        row["speedup"] = row["full_ttfl_ms"] / row["ttfl_ms"] if row["ttfl_ms"] > 0 else np.nan
        log_ratio = np.log(g["full_ttfl_ms"].to_numpy(np.float64) / g["ttfl_ms"].to_numpy(np.float64))
        lo, hi = bootstrap_ci(log_ratio, confidence=confidence, seed=seed)
        row.update({"speedup_gmean": float(np.exp(log_ratio.mean())), "speedup_ci_low": float(np.exp(lo)),
                    "speedup_ci_high": float(np.exp(hi))})
        rows.append(row)
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class OperatingDecision:
    """The operating rule's choice for one workload.

    Attributes:
        serve: ``"repair"`` (a reuse path) or ``"full prefill"``.
        label: the chosen reuse path's label (``"Full prefill"`` when serving by full prefill).
        preservation: its answer preservation (1.0 for full prefill).
        ttfl_ms: its median TTFL, ms.
        full_ttfl_ms: full prefill's median TTFL, ms.
        reason: why, in words.
    """

    serve: str
    label: str
    preservation: float
    ttfl_ms: float
    full_ttfl_ms: float
    reason: str = field(default="")


def operating_rule(summary: pd.DataFrame, *, required_preservation: float = 0.95, use_lower_bound: bool = False,
                   significant: bool = True, protocol: str = "forward") -> OperatingDecision:
    """Serve by full prefill unless a reuse path reaches the required preservation *and* is faster (SAFE-KV Fig. 5).

    Candidates are the summary rows of ``protocol`` (donor-copy is a diagnostic and never a serving path) other than
    full prefill and other than oracle-selected units (gold evidence labels are unknown when serving), including prefix
    composition without repair. A candidate qualifies when its preservation (or its lower confidence bound with
    ``use_lower_bound``) reaches ``required_preservation`` and it is faster than full prefill: with ``significant``,
    the 95 % bootstrap interval of its per-request speed-up (``speedup_ci_low``, geometric mean of
    ``full_ttfl / ttfl``) lies above 1, so CPU timing noise alone cannot select it; otherwise its median TTFL is below
    full prefill's. The qualifying candidate with the smallest median TTFL is served; with none, full prefill.

    Args:
        summary: one workload's rows of :func:`summarize`.
        required_preservation: in [0, 1].
        use_lower_bound: judge preservation by ``ci_low`` instead of the point estimate.
        significant: judge "faster" by the speed-up interval instead of the medians.
        protocol: the serving protocol (``"forward"``).

    Raises:
        ValueError: naming ``required_preservation`` outside [0, 1], ``summary`` when it has no full-prefill row or
            mixes workloads (several full-prefill TTFLs).
    """
    if not 0.0 <= required_preservation <= 1.0:
        raise ValueError(f"required_preservation={required_preservation!r} must lie in [0, 1]")
    full_rows = summary[summary["unit"] == "full"]
    if full_rows.empty:
        raise ValueError("summary has no full-prefill row")
    if full_rows["full_ttfl_ms"].nunique() > 1:
        raise ValueError("summary mixes workloads; pass one workload's rows")
    full_ttfl = float(full_rows["ttfl_ms"].iloc[0])
    # Gold-evidence (oracle) selection is unavailable when serving, like donor-copy: diagnostics only.
    cand = summary[(summary["protocol"] == protocol) & (summary["unit"] != "full") & (summary["selector"] != "oracle")]
    measure = cand["ci_low"] if use_lower_bound else cand["preservation"]
    ok = cand[measure >= required_preservation]
    if ok.empty:
        return OperatingDecision("full prefill", "Full prefill", 1.0, full_ttfl, full_ttfl,
                                 f"no reuse path reaches {required_preservation:.0%} preservation")
    faster = ok[ok["speedup_ci_low"] > 1.0] if significant else ok[ok["ttfl_ms"] < full_ttfl]
    if faster.empty:
        best = ok.sort_values(["ttfl_ms", "repair_ratio"]).iloc[0]
        how = (f"speed-up {best['speedup_gmean']:.2f}x [{best['speedup_ci_low']:.2f}, {best['speedup_ci_high']:.2f}]"
               if significant else f"{best['ttfl_ms']:.0f} ms vs {full_ttfl:.0f} ms")
        return OperatingDecision(
            "full prefill", "Full prefill", 1.0, full_ttfl, full_ttfl,
            f"no path at {required_preservation:.0%} is faster than full prefill; the fastest, {best['label']}, has "
            f"{how}",
        )
    best = faster.sort_values(["ttfl_ms", "repair_ratio"]).iloc[0]
    return OperatingDecision(
        "repair", str(best["label"]), float(best["preservation"]), float(best["ttfl_ms"]), full_ttfl,
        f"{best['label']} preserves {best['preservation']:.0%} at {best['ttfl_ms']:.0f} ms vs {full_ttfl:.0f} ms "
        f"(speed-up {best['speedup_gmean']:.2f}x [{best['speedup_ci_low']:.2f}, {best['speedup_ci_high']:.2f}])",
    )


def _pick(summary: pd.DataFrame, label: str, protocol: str = "forward") -> pd.Series | None:
    rows = summary[(summary["label"] == label) & (summary["protocol"] == protocol)]
    return rows.iloc[0] if len(rows) else None


def _fmt(row: pd.Series | None) -> str:
    if row is None:
        return "not run"
    return f"{row['preservation']:.1%} [{row['ci_low']:.2f}, {row['ci_high']:.2f}] at ratio {row['repair_ratio']:.2f}"


def design_ledger(summary: pd.DataFrame, *, required_preservation: float = 0.95, budgets: Sequence[float] = (50,),
                  drift_spearman: float | None = None,
                  decisions: dict[str, OperatingDecision] | None = None) -> pd.DataFrame:
    """The design ledger (SAFE-KV Table 27) filled from measurements (actual forwarding unless stated).

    Each row states a route, what was measured, whether it worked by a stated criterion, and the criterion.

    Args:
        summary: :func:`summarize` pooled over workloads with ``by=("label", "protocol")``.
        required_preservation: the preservation a route must reach to count as having worked, in [0, 1].
        budgets: the adaptive/SUR budgets that were run (the largest is compared).
        drift_spearman: Spearman correlation of the risk score with measured document drift, if measured.
        decisions: workload -> :func:`operating_rule` decision, if computed.

    Returns:
        DataFrame with columns ``experiment``, ``key_result``, ``worked`` (bool, or None when not run) and
        ``criterion``.
    """
    b = max(budgets) if budgets else None
    req = required_preservation
    comp = _pick(summary, "Prefix composition")
    doc = _pick(summary, "Doc K2 · oracle")
    w4 = _pick(summary, "w4 K1 · risk")
    suf1 = _pick(summary, "Suffix K1 · risk")
    suf2 = _pick(summary, "Suffix K2 · risk")
    link = _pick(summary, "Linked K2 · oracle")
    osuf = _pick(summary, "Suffix K1 · oracle")
    ada = _pick(summary, f"Adaptive K2 {b:g}% · risk") if b is not None else None
    sur = _pick(summary, f"SUR {b:g}%") if b is not None else None
    qsuf = _pick(summary, "Suffix K2 · query")
    dsuf = _pick(summary, "Suffix K1 · risk", "donor")

    def val(r):
        return None if r is None else float(r["preservation"])

    def ge(x, y):
        return None if x is None or y is None else bool(val(x) >= val(y))

    rows = [
        ("Prefix composition (no repair)", _fmt(comp), None if comp is None else val(comp) >= req,
         f"preserves >= {req:.0%}"),
        ("Document-only repair (oracle: the gold documents)", f"{_fmt(doc)}; oracle suffix {_fmt(osuf)}",
         None if doc is None else val(doc) >= req, f"preserves >= {req:.0%}"),
        ("Downstream window w4 vs suffix K1 (risk, same start)", f"w4 {_fmt(w4)}; suffix {_fmt(suf1)}", ge(w4, suf1),
         "window preserves at least as much as the suffix"),
        ("Linked intervals vs suffix (oracle)", f"linked K2 {_fmt(link)}; suffix K1 {_fmt(osuf)}", ge(link, osuf),
         "linked preserves at least as much as the suffix"),
        (f"Adaptive suffix {b:g}% vs suffix K2 (risk)", f"adaptive {_fmt(ada)}; suffix K2 {_fmt(suf2)}", ge(ada, suf2),
         "trimmed suffix preserves at least as much"),
        (f"SUR {b:g}% vs adaptive suffix {b:g}%", f"SUR {_fmt(sur)}; adaptive {_fmt(ada)}", ge(sur, ada),
         "SUR preserves at least as much at the same budget"),
        ("Query-guided vs risk-guided start (suffix K2)", f"query {_fmt(qsuf)}; risk {_fmt(suf2)}", ge(qsuf, suf2),
         "query selector preserves at least as much"),
        ("Donor-copy vs actual forwarding (suffix K1, risk)", f"donor {_fmt(dsuf)}; forward {_fmt(suf1)}",
         None if dsuf is None or suf1 is None else bool(abs(val(dsuf) - val(suf1)) <= 0.05),
         "donor-copy within 5 points of actual forwarding (the diagnostic is a usable proxy)"),
    ]
    if drift_spearman is not None:
        rows.append(("Risk score vs measured document drift", f"Spearman rho = {drift_spearman:.2f}",
                     bool(drift_spearman >= 0.5), "rho >= 0.5"))
    if decisions:
        served = {wl: d.serve if d.serve == "full prefill" else f"repair ({d.label})" for wl, d in decisions.items()}
        rows.append(("Operating rule", "; ".join(f"{wl}: {v}" for wl, v in served.items()),
                     any(d.serve == "repair" for d in decisions.values()),
                     f"some workload is served by a reuse path faster than full prefill at >= {req:.0%}"))
    return pd.DataFrame(rows, columns=["experiment", "key_result", "worked", "criterion"])


# ---------------------------------------------------------------------------------------------------------------------
# Figures (SAFE-KV Figures 2, 3, 5 analogues)

LOCAL_VS_SUFFIX = ("Prefix composition", "Doc K1 · risk", "w2 K1 · risk", "w3 K1 · risk", "w4 K1 · risk",
                   "Suffix K1 · risk")
#: Marker style per protocol: filled for actual forwarding, open for the donor-copy diagnostic.
_PROTOCOL_STYLE = {"forward": ("o", True), "donor": ("s", False)}


def _short(label: str) -> str:
    return label.replace("Prefix composition", "Composition").replace(" · risk", "").replace(" · ", "\n")


def plot_local_vs_suffix(summary: pd.DataFrame, *, labels: Sequence[str] = LOCAL_VS_SUFFIX, title: str = ""):
    """Figure 2 analogue: preservation (95 % CI) of composition, document-only, windows and the suffix from one start.

    Args:
        summary: :func:`summarize` rows with ``workload`` (one panel each), ``label`` and ``protocol`` columns.
        labels: the labels to draw, left to right (local units first, then the suffix).
        title: figure title (a default names the selector and the interval).

    Returns:
        The matplotlib figure: methods on the x axis with their mean repair ratio under the name; filled circles for
        actual forwarding, open squares for donor-copy (diagnostic upper bound), side by side.
    """
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(summary["workload"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.0 * len(workloads), 3.8), sharey=True, squeeze=False)
    xs = np.arange(len(labels))
    for ax, wl in zip(axes[0], workloads):
        sub = summary[summary["workload"] == wl]
        for j, proto in enumerate(p for p in PROTOCOLS if p in set(sub["protocol"])):
            marker, fill = _PROTOCOL_STYLE[proto]
            pts = sub[sub["protocol"] == proto].set_index("label").reindex(list(labels))
            ax.errorbar(xs + (j - 0.5) * 0.22, pts["preservation"],
                        yerr=[pts["preservation"] - pts["ci_low"], pts["ci_high"] - pts["preservation"]],
                        fmt=marker, color=f"C{j}", mfc=f"C{j}" if fill else "white", capsize=2, lw=1,
                        label=PROTOCOL_LABELS[proto])
        ratio = sub[sub["protocol"] == "forward"].set_index("label").reindex(list(labels))["repair_ratio"]
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{_short(lab)}\n{r:.0%}" if np.isfinite(r) else _short(lab)
                            for lab, r in zip(labels, ratio)], fontsize=7)
        ax.set_title(wl)
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("answer preservation vs full prefill")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8, bbox_to_anchor=(0.5, -0.06))
    fig.suptitle(title or "Local repair vs causal suffix repair from the same start (risk K1); under each method: "
                 "mean repair ratio; error bars: 95 % bootstrap CI", fontsize=10)
    fig.tight_layout()
    return fig


def plot_position_sweep(summary: pd.DataFrame, *, title: str = ""):
    """Figure 3 analogue: preservation against the evidence slot, one line per method, one panel per protocol.

    Args:
        summary: :func:`summarize` rows with ``slot``, ``label`` and ``protocol`` columns (and ``ci_low``/``ci_high``).
        title: figure title.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    protocols = [p for p in PROTOCOLS if p in set(summary["protocol"])]
    fig, axes = plt.subplots(1, len(protocols), figsize=(4.8 * len(protocols), 3.6), sharey=True, squeeze=False)
    for ax, proto in zip(axes[0], protocols):
        sub = summary[summary["protocol"] == proto]
        groups = list(sub.groupby("label", sort=False))
        for j, (lab, g) in enumerate(groups):
            g = g.sort_values("slot")
            err = [g["preservation"] - g["ci_low"], g["ci_high"] - g["preservation"]]
            # Side-by-side offsets keep coinciding points and intervals readable.
            ax.errorbar(g["slot"] + (j - (len(groups) - 1) / 2) * 0.06, g["preservation"], yerr=err, marker="o",
                        capsize=2, lw=1.2, elinewidth=0.8, label=lab)
        ax.set_title(PROTOCOL_LABELS[proto])
        ax.set_xlabel("slot of the first gold document")
        ax.set_xticks(sorted(sub["slot"].unique()))
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("answer preservation vs full prefill")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title or "Evidence position sweep (oracle selector); error bars: 95 % bootstrap CI", fontsize=10)
    fig.tight_layout()
    return fig


_UNIT_NAMES = {"none": "prefix composition", "doc": "document-only", "window": "window w2–w4",
               "suffix": "causal suffix", "adaptive": "adaptive suffix", "linked": "linked intervals", "sur": "SUR", "full": "full prefill"}
_SELECTOR_MARKERS = {"": "o", "risk": "o", "query": "^", "oracle": "D"}


def plot_pareto_ttfl(summary: pd.DataFrame, *,
                     highlight: Sequence[str] = ("Suffix K1 · risk", "Suffix K2 · risk", "Suffix K2 · query"),
                     title: str = ""):
    """Figure 5 analogue: quality–budget operating points (left) and median TTFL against full prefill (right).

    Args:
        summary: :func:`summarize` rows per workload with ``workload``, ``label``, ``unit``, ``selector``, ``protocol``.
        highlight: reuse paths drawn against full prefill in the TTFL panel (actual forwarding).
        title: figure title.

    Returns:
        The matplotlib figure. Left: mean over workloads of each configuration's repair ratio and preservation; colour =
        repair unit, marker = selector (circle risk / none, triangle query, diamond oracle), filled = actual
        forwarding, open = donor-copy (diagnostic upper bound). Right: median TTFL per workload, labels = mean ratio.
    """
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.15, 1]})
    keys = ["label", "protocol", "unit", "selector"]
    pooled = summary.groupby(keys, sort=False)[["repair_ratio", "preservation"]].mean().reset_index()
    units = [u for u in UNITS if u in set(pooled["unit"])]
    colors = {u: f"C{i}" for i, u in enumerate(units)}
    for _, r in pooled.iterrows():
        marker = _SELECTOR_MARKERS.get(r["selector"], "o")
        fill = r["protocol"] == "forward"
        left.scatter(r["repair_ratio"], r["preservation"], marker=marker, s=46 if fill else 70, zorder=3 if fill else 2,
                     facecolors=colors[r["unit"]] if fill else "none", edgecolors=colors[r["unit"]], linewidths=1.2)
    handles = [plt.Line2D([], [], marker="s", ls="", color=colors[u], label=_UNIT_NAMES[u]) for u in units]
    handles += [plt.Line2D([], [], marker=m, ls="", color="0.4", label=f"selector: {s}")
                for s, m in (("risk", "o"), ("query", "^"), ("oracle", "D"))]
    handles += [plt.Line2D([], [], marker="o", ls="", color="0.4", label=PROTOCOL_LABELS["forward"]),
                plt.Line2D([], [], marker="o", ls="", color="0.4", mfc="none", label=PROTOCOL_LABELS["donor"])]
    left.legend(handles=handles, fontsize=6.5, loc="upper left", ncol=2)
    left.set_xlabel("mean repair ratio (fraction of document tokens re-encoded)")
    left.set_ylabel("answer preservation (mean over workloads)")
    left.set_xlim(-0.03, 1.05)
    left.set_ylim(-0.05, 1.35)
    left.set_yticks(np.linspace(0, 1, 6))
    left.set_title("quality–budget operating points", fontsize=10)

    workloads = list(dict.fromkeys(summary["workload"]))
    names = ["Full prefill", *highlight]
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        vals, ratios = [], []
        for wl in workloads:
            r = _pick(summary[summary["workload"] == wl], name)
            vals.append(np.nan if r is None else r["ttfl_ms"])
            ratios.append(np.nan if r is None else r["repair_ratio"])
        xs = np.arange(len(workloads)) + (j - (len(names) - 1) / 2) * width
        right.bar(xs, vals, width, label=name + ("" if name == "Full prefill" else " (actual forwarding)"))
        if name != "Full prefill":
            for x, v, q in zip(xs, vals, ratios):
                if np.isfinite(v):
                    right.annotate(f"{q:.0%}", (x, v), ha="center", va="bottom", fontsize=6.5)
    right.set_xticks(np.arange(len(workloads)))
    right.set_xticklabels(workloads, fontsize=8)
    right.set_ylabel("median time to first logit (ms, CPU)")
    right.set_title("TTFL vs full prefill (labels: mean repair ratio)", fontsize=10)
    right.legend(fontsize=7)
    fig.suptitle(title or "Quality–budget Pareto and time to first logit", fontsize=11)
    fig.tight_layout()
    return fig


__all__ = [
    "PROTOCOLS",
    "PROTOCOL_LABELS",
    "SELECTORS",
    "SELECTOR_UNITS",
    "UNITS",
    "OperatingDecision",
    "RagRequest",
    "RepairPlan",
    "RepairSpec",
    "adaptive_suffix_support",
    "answers_agree",
    "bootstrap_ci",
    "build_request",
    "default_specs",
    "sweep_specs",
    "design_ledger",
    "drift_table",
    "document_drift",
    "document_support",
    "donor_copy",
    "evaluate_prompt",
    "greedy_answer",
    "linked_support",
    "operating_rule",
    "oracle_scores",
    "place_evidence",
    "plan_repair",
    "plot_local_vs_suffix",
    "plot_pareto_ttfl",
    "plot_position_sweep",
    "query_scores",
    "rag_passages",
    "rank_documents",
    "repair_ratio",
    "risk_components",
    "risk_scores",
    "run_protocol",
    "run_requests",
    "selector_scores",
    "start_candidates",
    "suffix_support",
    "summarize",
    "window_support",
    "workload_name",
]
