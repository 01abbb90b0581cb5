"""SAFE-KV protocols, the repair-unit sets of the study, and RAG requests built from QA examples.

``forward`` recomputes a repair unit's support with an executor (actual forwarding); ``donor`` copies the support's rows
from the full-prefill cache, a diagnostic upper bound. The study's sweep (:mod:`sur_lab.studies.noprefix.study`) runs
every unit with each protocol through :func:`sur_lab.sweeps.run_case`; :func:`build_request` builds its RAG requests.

Source: SAFE-KV (Zhang, 2026), abstract, Figures 1-5, Tables 20 and 27.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transformers import DynamicCache

from sur_lab.analysis.scoring import normalize_answer, score_example
from sur_lab.budget import Support
from sur_lab.cache_ops import (
    cache_length,
    clone_cache,
    layer_deviation,
    to_tensors,
    write_rows_,
)
from sur_lab.edits import EditedContext
from sur_lab.executors import get_executor
from sur_lab.models import LoadedModel
from sur_lab.studies.noprefix.composition import (
    ComposedPrompt,
    CompositionCaches,
    compose_prompt,
)
from sur_lab.studies.noprefix.selection import (
    PROTOCOLS,
    RepairSpec,
)

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
# Answer preservation



def answers_agree(text: str, reference: str) -> bool:
    """Answer preservation: the two generated answers are equal after :func:`sur_lab.analysis.scoring.normalize_answer`.

    The whole greedy continuation (up to ``max_new_tokens``) is compared, not only its first line: a small model often
    opens with a lead-in line ("The answer to this question is:") whose first-line extraction would call any two
    answers with the same lead-in preserved. (``extracted_agree`` in the records keeps the extracted-answer rule.)
    """
    return normalize_answer(" ".join(text.split())) == normalize_answer(" ".join(reference.split()))



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
    Adaptive K2 at ``budgets``; query-guided and hybrid (risk and query ranks) Suffix K2; oracle evidence Doc K2 (the
    gold documents), Linked K2 and Suffix K1; SUR at ``budgets``.

    Raises:
        ValueError: naming ``budget_pct`` for a budget outside [0, 100].
    """
    specs = [RepairSpec("none"), RepairSpec("doc", "risk", 1)]
    specs += [RepairSpec("window", "risk", 1, width=w) for w in (2, 3, 4)]
    specs += [RepairSpec("suffix", "risk", 1), RepairSpec("suffix", "risk", 2)]
    specs += [RepairSpec("adaptive", "risk", 2, budget_pct=b) for b in budgets]
    specs += [RepairSpec("suffix", "query", 2), RepairSpec("suffix", "hybrid", 2)]
    specs += [RepairSpec("doc", "oracle", 2), RepairSpec("linked", "oracle", 2), RepairSpec("suffix", "oracle", 1)]
    specs += [RepairSpec("sur", budget_pct=b) for b in budgets]
    return specs


def sweep_specs() -> list[RepairSpec]:
    """The evidence position sweep (Figure 3): prefix composition, oracle Doc K2 (the gold documents) and oracle
    Suffix K1 (from the first gold document)."""
    return [RepairSpec("none"), RepairSpec("doc", "oracle", 2), RepairSpec("suffix", "oracle", 1)]


# ---------------------------------------------------------------------------------------------------------------------
# Building RAG prompts from QA examples


def _example_rng(example_id: str, seed: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(str(example_id).encode())])


def rag_passages(example, num_docs: int, *, seed: int = 0, filler: Sequence = ()) -> list:
    """The n passages of one RAG request: all gold passages, the example's own distractors, then filler passages.

    Filler (other questions' paragraphs, whose titles differ from this example's) pads to ``num_docs`` when the
    example's own passages run out (a Noise16 analogue). The order is a seeded permutation per example.

    Args:
        example: a :class:`~sur_lab.data.qa.QAExample`.
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
    then :func:`sur_lab.studies.noprefix.compose_prompt`; gold EM by :func:`sur_lab.analysis.scoring.score_example`.

    Raises:
        ValueError: see :func:`rag_passages`, :func:`place_evidence` and :func:`compose_prompt`.
    """
    passages = rag_passages(example, num_docs, seed=seed, filler=filler)
    if slot is not None:
        passages = place_evidence(passages, slot)
    prompt = compose_prompt(tokenizer, passages, example.question, max_doc_tokens=max_doc_tokens)
    meta = {"dataset": example.dataset, "source_id": example.id, "num_docs": num_docs,
            "slot": -1 if slot is None else int(slot)}
    return RagRequest(prompt, meta, lambda pred, ex=example: score_example(pred, ex))


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

__all__ = [
    "DATASET_NAMES",
    "RagRequest",
    "answers_agree",
    "build_request",
    "default_specs",
    "document_drift",
    "donor_copy",
    "place_evidence",
    "rag_passages",
    "run_protocol",
    "sweep_specs",
    "workload_name",
]
