"""Run several repair methods on one edit and score them against Re-prefill and gold answers.

One call per case: the Dirty and Shift caches are built once (``prepare``) and shared by every method; Re-prefill is
always run first so that every method is compared with its answer (agreement) and its first-token distribution
(total variation). Records are flat dicts ready for a DataFrame / Parquet (appendix 12 lists what a record keeps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sur_lab.allocators import get_allocator
from sur_lab.analysis.scoring import agreement, extract_answer, first_token_tv
from sur_lab.answer import answer
from sur_lab.budget import check_budget
from sur_lab.edits import EditedContext
from sur_lab.models import LoadedModel
from sur_lab.repair import REFERENCE_METHODS, PreparedEdit, prepare, repair

#: Reference methods in the order tables show them.
DEFAULT_REFERENCES = ("Dirty", "Shift", "Replay", "Re-prefill")


def method_grid(methods: Sequence[str], budgets: Sequence[float]) -> list[tuple[str, float]]:
    """Cross allocator methods with budgets; reference methods appear once with a NaN budget.

    Raises:
        ValueError: for an unknown method name or a budget outside [0, 100] (before any work).
    """
    grid: list[tuple[str, float]] = []
    for m in methods:
        if m in REFERENCE_METHODS:
            grid.append((m, float("nan")))
            continue
        get_allocator(m)
        grid.extend((m, check_budget(b)) for b in budgets)
    return grid


def evaluate_case(
    lm: LoadedModel,
    edit: EditedContext,
    methods: Sequence[str] = DEFAULT_REFERENCES + ("SUR",),
    budgets: Sequence[float] = (2, 5, 10, 20),
    *,
    max_new_tokens: int = 64,
    gold: Sequence[str] | None = None,
    scorer: Callable[[str], bool] | None = None,
    executor: str = "sequential",
    prepared: PreparedEdit | None = None,
    seed: int = 0,
    keep_logits: bool = False,
) -> list[dict[str, Any]]:
    """Repair ``edit`` with every (method, budget), answer the query, and score each answer.

    Args:
        lm: the model.
        edit: the edit.
        methods: reference methods and/or allocator names.
        budgets: budgets in percent for allocator methods.
        max_new_tokens: decoding limit, tokens.
        gold: gold answers; when given (and ``scorer`` is not), ``em`` is normalized exact match over them.
        scorer: ``fn(extracted_answer) -> bool`` overriding the gold EM rule (dataset-specific scorers).
        executor: sparse-refresh executor name.
        prepared: precomputed Dirty/Shift caches (computed here otherwise).
        seed: case-fixed seed for randomized allocators.
        keep_logits: also store ``first_token_logits`` (float32 numpy ``[V]``) in each record.

    Returns:
        One record per (method, budget) with: ``method``, ``budget_pct``, ``allowance`` (B), ``suffix_len`` (S),
        ``num_intervals`` (R), ``positions``, ``intervals``, ``select_ms``, ``shift_ms``, ``refresh_ms``,
        ``answer_ms``, ``latency_ms`` (Eq. 20 sum), ``extra_forward_tokens``, ``answer`` (raw text), ``prediction``
        (extracted), ``em`` (bool or None), ``agree_reprefill``, ``tv_reprefill`` and ``finished``.

    Raises:
        ValueError: for unknown methods or budgets outside [0, 100], before any model call.
    """
    from sur_lab.analysis.scoring import exact_match

    grid = method_grid(methods, budgets)
    prepared = prepared or prepare(lm, edit)
    ref_result = repair(lm, prepared, "Re-prefill")
    ref = answer(lm, ref_result.cache, edit, max_new_tokens=max_new_tokens)
    ref_pred = extract_answer(ref.text)
    records = []
    for method, budget in grid:
        if method == "Re-prefill":
            result, ans = ref_result, ref
        else:
            result = repair(lm, prepared, method, budget, executor=executor, seed=seed)
            ans = answer(lm, result.cache, edit, max_new_tokens=max_new_tokens)
        pred = extract_answer(ans.text)
        if scorer is not None:
            em = bool(scorer(pred))
        elif gold is not None:
            em = bool(exact_match(pred, list(gold)))
        else:
            em = None
        support = result.support
        t = result.timings_ms
        rec = {
            "method": method,
            "budget_pct": budget,
            "allowance": result.allowance,
            "suffix_len": edit.suffix_len,
            "num_intervals": support.num_intervals if support is not None else (1 if result.allowance else 0),
            "positions": support.positions.tolist() if support is not None else [],
            "intervals": [list(iv) for iv in support.intervals] if support is not None else [],
            "select_ms": t["select"],
            "shift_ms": t["shift"],
            "refresh_ms": t["refresh"],
            "answer_ms": ans.timings_ms["answer"],
            "latency_ms": t["select"] + t["shift"] + t["refresh"] + ans.timings_ms["answer"],
            "extra_forward_tokens": result.selection.extra_forward_tokens if result.selection else 0,
            "answer": ans.text,
            "prediction": pred,
            "em": em,
            "agree_reprefill": agreement(pred, ref_pred),
            "tv_reprefill": first_token_tv(ans.first_token_logits, ref.first_token_logits),
            "finished": ans.finished,
        }
        if keep_logits:
            rec["first_token_logits"] = ans.first_token_logits.numpy().astype(np.float32)
        records.append(rec)
    return records
