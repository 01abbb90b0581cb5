"""SAFE-KV repair units and selectors: which composed-document positions to re-encode (a :class:`Support`).

Selectors (``risk``, ``query``, ``hybrid``, ``oracle``) score the n documents; start candidates are a selector's top-K documents
(earlier document first among ties). Repair units (``doc``, ``window``, ``suffix``, ``adaptive``, ``linked``, ``sur``,
``none``, ``full``) turn candidates into a :class:`~sur_lab.budget.Support` over the ``S`` positions after the shared
prefix; :class:`RepairSpec` names one (unit, selector, K, width, budget) and :func:`plan_repair` resolves it for a prompt.
See :mod:`sur_lab.studies.noprefix` for the whole study.

Source: SAFE-KV (Zhang, 2026), section 1, Figure 1, Table 27; SUR: section 3.2 and Algorithm 1 of the budgeted repair
paper.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import rankdata
from transformers import DynamicCache

from sur_lab.allocators import AllocationRequest, allocate
from sur_lab.allocators.sur import token_relevance, unit_scores
from sur_lab.budget import Support, allowance, check_budget
from sur_lab.edits import EditedContext
from sur_lab.models import LoadedModel
from sur_lab.studies.noprefix.composition import ComposedPrompt, composition_edit
from sur_lab.units import Unit

UNITS = ("none", "doc", "window", "suffix", "adaptive", "linked", "sur", "full")
#: Units whose support depends on a selector's start candidates.
SELECTOR_UNITS = ("doc", "window", "suffix", "adaptive", "linked")
SELECTORS = ("risk", "query", "hybrid", "oracle")
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


def rank_scale(scores) -> np.ndarray:
    """Scores as ranks scaled to (0, 1]: ``rank / n`` with rank 1 for the lowest score and tied scores sharing their
    average rank (float64 ``[n]``); the scale on which :func:`hybrid_scores` averages two selectors."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    return rankdata(s, method="average") / len(s) if len(s) else s


@torch.inference_mode()
def hybrid_scores(lm: LoadedModel, prompt: ComposedPrompt) -> np.ndarray:
    """Hybrid selector: the mean of the risk and query selectors' scaled ranks (:func:`rank_scale`).

    ``hybrid_i = (rank_scale(risk)_i + rank_scale(query)_i) / 2``: a document ranks high when it both drifts (risk,
    forward-free) and is relevant to the question (query, frozen embeddings). Ranks make the two scales commensurate
    (risk lies in [0, 1], query relevance in [-1, 1.25]). SAFE-KV (Figure 4, Table 27) reports a hybrid selector
    beside query and risk without a formula in the text this project holds; this rank average is this project's
    definition. Ties (frequent on few documents) fall to the earlier document (:func:`rank_documents`), the id
    tie-break the paper notes decides many of its hybrid rows.

    Returns:
        float64 ``[n]`` in (0, 1].
    """
    return (rank_scale(risk_scores(prompt)) + rank_scale(query_scores(lm, prompt))) / 2.0


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
    """Scores of ``selector`` (``"risk"``, ``"query"``, ``"hybrid"``, ``"oracle"``), float64 ``[n]``.

    Raises:
        ValueError: naming ``selector`` when unknown, ``lm`` when the query or hybrid selector gets none.
    """
    if selector == "risk":
        return risk_scores(prompt)
    if selector == "query":
        if lm is None:
            raise ValueError("lm is required by the query selector (frozen input embeddings)")
        return query_scores(lm, prompt)
    if selector == "hybrid":
        if lm is None:
            raise ValueError("lm is required by the hybrid selector (its query part uses frozen input embeddings)")
        return hybrid_scores(lm, prompt)
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

__all__ = [
    "PROTOCOLS",
    "PROTOCOL_LABELS",
    "QUERY_TOP_K",
    "RepairPlan",
    "RepairSpec",
    "SELECTORS",
    "SELECTOR_UNITS",
    "UNITS",
    "adaptive_suffix_support",
    "document_support",
    "hybrid_scores",
    "linked_support",
    "oracle_scores",
    "plan_repair",
    "query_scores",
    "rank_documents",
    "rank_scale",
    "repair_ratio",
    "risk_components",
    "risk_scores",
    "selector_scores",
    "start_candidates",
    "suffix_support",
    "support_for",
    "window_support",
]
