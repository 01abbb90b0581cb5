"""SAFE-KV protocols and the evaluation of one request: repair a composed cache, answer, compare with full prefill.

``forward`` recomputes a repair unit's support with an executor (actual forwarding); ``donor`` copies the support's rows
from the full-prefill cache, a diagnostic upper bound. :func:`evaluate_prompt` runs every :class:`RepairSpec` on one
composed prompt and records the endpoints; :func:`run_requests` does so for many RAG requests built from QA examples.

Source: SAFE-KV (Zhang, 2026), abstract, Figures 1-5, Tables 20 and 27.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from transformers import DynamicCache

from sur_lab.analysis.scoring import (
    agreement,
    extract_answer,
    first_token_tv,
    normalize_answer,
)
from sur_lab.answer import Answer, greedy_answer
from sur_lab.budget import Support
from sur_lab.cache_ops import (
    cache_length,
    caches_equal,
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
    build_caches,
    compose_prompt,
    composition_edit,
    prefix_cache,
)
from sur_lab.studies.noprefix.selection import (
    PROTOCOLS,
    RepairPlan,
    RepairSpec,
    plan_repair,
    risk_scores,
    selector_scores,
)
from sur_lab.units import segment_units

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


#: Record columns of :func:`evaluate_prompt` that only some repair units have (NaN for the others).
SPEC_PARAMETER_COLUMNS = ("width", "budget_pct")


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
        doc_store: optional document cache store ``doc_store_key(lm, prompt, i) -> document cache`` (model
            fingerprint, prefix ids, document ids) reused across prompts (filled here). Its encoding time is offline and not part of any TTFL.
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
        example: a :class:`~sur_lab.studies.datasets.QAExample`.
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
    from sur_lab.analysis.scoring import score_example

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

    The spec parameters that apply to some units only (:data:`SPEC_PARAMETER_COLUMNS`: ``width`` for windows,
    ``budget_pct`` for adaptive suffixes and SUR) are dropped when no spec of ``specs`` has them (e.g. the position
    sweep's :func:`sweep_specs`), so a table never carries an all-NaN column; where some specs have them, the other
    rows hold NaN.

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
    df = pd.DataFrame(rows)
    return df.drop(columns=[c for c in SPEC_PARAMETER_COLUMNS if c in df and df[c].isna().all()])


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
    "SPEC_PARAMETER_COLUMNS",
    "answers_agree",
    "build_request",
    "default_specs",
    "document_drift",
    "donor_copy",
    "evaluate_prompt",
    "place_evidence",
    "rag_passages",
    "run_protocol",
    "run_requests",
    "sweep_specs",
    "workload_name",
]
