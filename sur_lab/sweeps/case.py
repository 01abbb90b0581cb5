"""One case into records: :func:`run_case`, the only place that turns a case into :class:`~sur_lab.sweeps.record.Record`
objects.

Per case: the Dirty prefill and its Shift are computed once (:meth:`Case.prepare`); every (method, budget) of the grid
is repaired by the one Algorithm 1 dispatcher (:func:`sur_lab.repair.repair`); each repaired cache is answered
greedily after the query; the answers are scored against the gold answers and against Re-prefill (its answer, its
first-token distribution, and the teacher-forced NLL of its greedy continuation).
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sur_lab.allocators import get_allocator
from sur_lab.analysis.endpoints import nr_tv, reference_continuation
from sur_lab.analysis.scoring import agreement, exact_match, extract_answer, first_token_tv
from sur_lab.answer import Answer, answer, continuation_nll
from sur_lab.budget import check_budget
from sur_lab.cache_ops import cache_length
from sur_lab.edits import EditedContext
from sur_lab.executors import get_executor
from sur_lab.fingerprint import digest
from sur_lab.models import LoadedModel
from sur_lab.repair import REFERENCE_OPERATORS, PreparedEdit, RepairResult, prepare, repair
from sur_lab.sweeps.record import NO_BUDGET, Record, check_meta, config_fields, record_key

#: Default :func:`run_case` ``eval_batch`` (records answered together at most).
EVAL_BATCH = 1


@dataclass(frozen=True)
class Case:
    """One case of any study: an edit, its gold answers and the flat columns its records carry.

    Attributes:
        case_id: unique, stable identifier (part-file names derive from it).
        edit: the edit.
        gold: gold answers (for QA: the answer and its aliases; for NIAH: the ordered value list).
        meta: flat scalars copied into every record (dataset, placement, source_id, context_len, depth, ...).

    Raises:
        ValueError: (at construction) naming ``meta`` when a value is not a flat scalar or a key collides with a
            record field.
    """

    case_id: str
    edit: EditedContext
    gold: tuple[str, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gold", tuple(self.gold))
        object.__setattr__(self, "meta", {k: (v.item() if isinstance(v, np.generic) else v)
                                          for k, v in dict(self.meta).items()})
        check_meta(self.meta, self.case_id)

    def fingerprint(self) -> str:
        """:func:`case_fingerprint` of this case's edit, gold answers and meta (16 hex characters)."""
        return case_fingerprint(self.edit, self.gold, self.meta)

    def prepare(self, lm: LoadedModel) -> PreparedEdit:
        """What every method of the case starts from: the Dirty prefill and its Shift (:func:`sur_lab.repair.prepare`).

        A study whose stale cache is built otherwise (e.g. composed from separately cached documents) subclasses
        :class:`Case` and overrides this method.
        """
        return prepare(lm, self.edit)


def case_seed(seed: int, case_id: str) -> int:
    """The case-fixed seed passed to randomized allocators: a stable function of the sweep seed and ``case_id``."""
    return int(np.random.SeedSequence([int(seed), zlib.crc32(case_id.encode())]).generate_state(1)[0])


def case_fingerprint(edit: EditedContext, gold: Sequence[str] = (), meta: Mapping[str, Any] | None = None) -> str:
    """A short hash of a case's content: the edit's tokens, span, query and relevance query, its text offsets and
    message containers (SUR's semantic units read them), and the gold answers and meta copied into its records.

    Guards resumed records against changed cases (16 hex characters).
    """
    h = hashlib.sha1()
    for part in (edit.original_ids, edit.query_ids, edit.relevance_ids):
        h.update(np.asarray(part, dtype=np.int64).tobytes())
        h.update(b"|")
    h.update(f"{edit.prefix_len},{edit.deleted_len}".encode())
    extra = {
        "offsets": list(edit.edited_offsets) if edit.edited_offsets is not None else None,
        "containers": list(edit.containers or ()),
        "text": edit.edited_text,
    }
    if gold or meta:
        extra.update(gold=list(gold), meta=dict(meta or {}))
    h.update(digest(extra).encode())
    return h.hexdigest()[:16]


def method_grid(methods: Sequence[str], budgets: Sequence[float]) -> list[tuple[str, float]]:
    """Cross allocator methods with budgets; reference methods appear once with a NaN budget.

    Raises:
        ValueError: for an unknown method name or a budget outside [0, 100] (before any work).
    """
    grid: list[tuple[str, float]] = []
    for m in methods:
        if m in REFERENCE_OPERATORS:
            grid.append((m, NO_BUDGET))
            continue
        get_allocator(m)
        grid.extend((m, check_budget(b)) for b in budgets)
    return grid


def check_run_args(cases: Sequence[Case], methods, budgets, executor: str, max_new_tokens: int,
                   eval_batch: int) -> list[tuple[str, float]]:
    """Check a sweep's arguments before any work; return the (method, budget) grid.

    Raises:
        ValueError: naming ``methods``/``budgets`` (unknown method, budget outside [0, 100] %), ``executor``
            (unknown), ``max_new_tokens`` or ``eval_batch`` (not an integer >= 1), or ``cases`` (not a
            :class:`Case`, duplicate ``case_id``).
    """
    grid = method_grid(methods, budgets)
    get_executor(executor)
    for name, value in (("max_new_tokens", max_new_tokens), ("eval_batch", eval_batch)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
    for case in cases:
        if not isinstance(case, Case):
            raise ValueError(f"cases must hold sur_lab.sweeps.Case objects; got {type(case).__name__}")
    ids = [c.case_id for c in cases]
    if len(set(ids)) != len(ids):
        raise ValueError("cases must have unique case_id values")
    return grid


def _as_text(parsed: Any) -> str:
    if isinstance(parsed, str):
        return parsed
    return json.dumps(list(parsed) if isinstance(parsed, (list, tuple)) else parsed)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(a) == tuple(b)
    return a == b


def run_case(
    lm: LoadedModel,
    case: Case,
    methods: Sequence[str],
    budgets: Sequence[float],
    *,
    executor: str = "sequential",
    max_new_tokens: int = 64,
    eval_batch: int = EVAL_BATCH,
    timed: bool = False,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
    scorer: Callable[[Case, str], bool] | None = None,
    parser: Callable[[str], Any] | None = None,
    skip: Collection[tuple[str, str, str]] = (),
    emit: Callable[[Record], None] | None = None,
    workers: int = 1,
) -> list[Record]:
    """Repair ``case`` with every (method, budget) of the grid, answer the query, score, and return the records.

    Args:
        lm: the model.
        case: the case.
        methods: reference operators (one record each, budget NaN) and allocator names (one record per budget).
        budgets: budgets b in [0, 100], % of the suffix.
        executor: sparse-refresh executor name.
        max_new_tokens: greedy decoding limit, tokens (EOS-aware).
        eval_batch: records answered together at most (1: each record alone).
        timed: measure every record's answer timings on the record alone (per request, Eq. 20).
        seed: sweep seed; the case's allocators get :func:`case_seed` ``(seed, case.case_id)``.
        options: allocator options passed to every allocator (the case's Dirty cache is added as
            ``"dirty_cache"``).
        scorer: ``fn(case, answer_text) -> bool`` giving ``em``; default: when ``case.gold`` is non-empty, the parsed
            answer equals the gold sequence (a ``parser`` returning a list/tuple) or normalised exact match over the
            gold aliases (:func:`sur_lab.analysis.scoring.exact_match`); else ``em`` is None.
        parser: ``fn(answer_text) -> parsed`` for ``prediction`` and Re-prefill agreement (equality of the parsed
            answers); default :func:`sur_lab.analysis.scoring.extract_answer` with normalised agreement
            (:func:`sur_lab.analysis.scoring.agreement`).
        skip: record keys (:func:`sur_lab.sweeps.record.record_key`) not to make (already stored).
        emit: called with each record as soon as it is complete (the store appends it).
        workers: processes sharing the machine, recorded in each record.

    Returns:
        The records made, in grid order.

    Raises:
        ValueError: for an unknown method or executor, a budget outside [0, 100], or ``max_new_tokens`` /
            ``eval_batch`` < 1 (before any model call).
    """
    import torch

    grid = check_run_args([case], methods, budgets, executor, max_new_tokens, eval_batch)
    todo = [(m, b) for m, b in grid if record_key(m, b) not in set(skip)]
    if not todo:
        return []
    edit = case.edit
    config = config_fields(lm, seed=seed, executor=executor, max_new_tokens=max_new_tokens, eval_batch=eval_batch,
                           options=options)
    prepared = case.prepare(lm)
    seed_c = case_seed(seed, case.case_id)
    opts = {**dict(options or {})}
    if prepared.dirty_cache is not None:
        opts["dirty_cache"] = prepared.dirty_cache
    ref_result = repair(lm, prepared, "Re-prefill")
    ref = answer(lm, ref_result.cache, edit, max_new_tokens=max_new_tokens)
    dirty_result = repair(lm, prepared, "Dirty")
    wants_dirty = any(m == "Dirty" for m, _ in todo)
    dirty_ans = answer(lm, dirty_result.cache, edit, max_new_tokens=max_new_tokens if wants_dirty else 1)
    computed = {"Re-prefill": (ref_result, ref), "Dirty": (dirty_result, dirty_ans)}
    continuation = reference_continuation(ref.token_ids)
    tv_dirty = first_token_tv(dirty_ans.first_token_logits, ref.first_token_logits)
    ref_parsed = parser(ref.text) if parser is not None else extract_answer(ref.text)
    base = {
        **config, "case_id": case.case_id, "case_seed": seed_c, "case_fingerprint": case.fingerprint(),
        "workers": int(workers), "threads": torch.get_num_threads(), "meta": case.meta,
        "prefix_len": edit.prefix_len, "deleted_len": edit.deleted_len, "suffix_len": edit.suffix_len,
        "gold": case.gold, "dirty_ms": prepared.dirty_ms,
    }
    records = []
    for method, budget in todo:
        if method in computed:
            result, ans = computed[method]
        else:
            result = repair(lm, prepared, method, budget, executor=executor, seed=seed_c, options=opts)
            ans = answer(lm, result.cache, edit, max_new_tokens=max_new_tokens)
        nll = continuation_nll(lm, result.cache, edit, continuation) if continuation else float("nan")
        record = _record(base, case, method, budget, result, ans, ref, ref_parsed, tv_dirty, nll, len(continuation),
                         scorer, parser, timed=True)
        if emit is not None:
            emit(record)
        records.append(record)
    return records


def _record(base: dict, case: Case, method: str, budget: float, result: RepairResult, ans: Answer, ref: Answer,
            ref_parsed: Any, tv_dirty: float, nll: float, nll_tokens: int, scorer, parser, *, timed: bool) -> Record:
    """The record of one answered repair: support, timings, answer, and the endpoints against the gold answers and
    Re-prefill."""
    parsed = parser(ans.text) if parser is not None else extract_answer(ans.text)
    if scorer is not None:
        em = bool(scorer(case, ans.text))
    elif case.gold:
        if parser is not None and isinstance(parsed, (list, tuple)):
            em = tuple(parsed) == tuple(case.gold)
        else:
            em = bool(exact_match(str(parsed), list(case.gold)))
    else:
        em = None
    agree = _same(parsed, ref_parsed) if parser is not None else agreement(parsed, ref_parsed)
    tv = first_token_tv(ans.first_token_logits, ref.first_token_logits)
    support, sel, t = result.support, result.selection, result.timings_ms
    nan = float("nan")
    answer_t = ans.timings_ms if timed else {"query": nan, "decode": nan, "answer": nan}
    return Record(
        **base,
        method=method,
        budget_pct=float(budget),
        timed=bool(timed),
        cache_len=cache_length(result.cache),
        allowance=int(result.allowance),
        num_intervals=support.num_intervals if support is not None else (1 if result.allowance else 0),
        positions=tuple(support.positions.tolist()) if support is not None else (),
        intervals=tuple(tuple(iv) for iv in support.intervals) if support is not None else (),
        extra_forward_tokens=int(sel.extra_forward_tokens) if sel is not None else 0,
        extra_forward_layers=int(sel.diagnostics.get("extra_forward_layers", 0)) if sel is not None else 0,
        # SUR / SUR-IDF: units tied after rounding (appendix 7.3 tie rule); None for allocators without unit ranks.
        tied_units=sel.diagnostics.get("tied_units") if sel is not None else None,
        select_ms=t["select"],
        shift_ms=t["shift"],
        refresh_ms=t["refresh"],
        query_ms=answer_t["query"],
        decode_ms=answer_t["decode"],
        answer_ms=answer_t["answer"],
        latency_ms=t["select"] + t["shift"] + t["refresh"] + answer_t["answer"],
        answer=ans.text,
        prediction=_as_text(parsed),
        finished=bool(ans.finished),
        em=em,
        agree_reprefill=bool(agree),
        sequence_agree=tuple(ans.token_ids) == tuple(ref.token_ids),
        tv_reprefill=tv,
        tv_dirty_reprefill=tv_dirty,
        nr_tv=nr_tv(min(tv, 1.0), min(tv_dirty, 1.0)),
        nll_reprefill=nll,
        nll_tokens=nll_tokens,
    )


__all__ = ["EVAL_BATCH", "Case", "case_fingerprint", "case_seed", "check_run_args", "method_grid", "run_case"]
