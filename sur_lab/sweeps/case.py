"""One case into records: :func:`run_case`, the only place that turns a case into :class:`~sur_lab.sweeps.record.Record`
objects.

Per case: the Dirty prefill and its Shift are computed once (:meth:`Case.prepare`); every (method, budget) of the grid
is repaired by the one Algorithm 1 dispatcher (:func:`sur_lab.repair.repair`); the repaired caches are answered
greedily after the query, ``eval_batch`` at a time (:class:`sur_lab.answer.AnswerBatch`: one query forward, batched
decoding with per-row stopping, teacher-forced scoring in the same batch); each answer is scored against the gold
answers and against Re-prefill (its answer and token ids, its first-token distribution and logits, the NLL of its
greedy continuation), and the canonical gold answer is teacher-forced (:attr:`Case.answer_ids`: ``gold_nll``,
``gold_margin``). Answer timings come only from unbatched passes (:attr:`Record.timed`).

Adding an endpoint (a record field computed from each answer):

1. declare the field in :class:`~sur_lab.sweeps.record.Record` with its unit, and its type in
   :data:`~sur_lab.sweeps.record.FIELD_TYPES`;
2. if it needs teacher forcing, add the token sequence to :func:`_targets` under a name (e.g. the gold answer's ids,
   :attr:`Case.answer_ids`): every row's log-probabilities of it
   are then computed in one batched forward and passed to :func:`_endpoints` as ``logprobs[name]`` (``[T]`` float64);
3. compute the field in :func:`_endpoints` from ``ans`` (text, token ids, float32 first-token logits), ``logprobs``
   and the case's references ``refs`` (Re-prefill's answer, Dirty's first-token logits), e.g.
   ``"gold_nll": float(-logprobs["gold"].mean())``.

Endpoints against the case's Re-prefill answer (:mod:`sur_lab.analysis.endpoints`): ``tv_reprefill``, ``nr_tv``,
``jsd_reprefill``, ``argmax_agree``, ``logits_identical`` (and the row's own ``logits_digest``), ``sequence_agree``,
``agree_reprefill``, ``nll_reprefill``; against the gold answer: ``em``, ``gold_nll``, ``gold_margin``; against a
superseded value the case declares (``meta["old_token"]``): ``old_margin``.

Nothing else changes: the store, the schedulers and the tables take the new field as it comes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from sur_lab.allocators import Selection, get_allocator
from sur_lab.analysis.endpoints import (
    argmax_agree,
    canonical_answer_ids,
    first_token_jsd,
    gold_margin,
    logits_digest,
    old_margin,
    logits_identical,
    nr_tv,
    reference_continuation,
    sequence_agree,
)
from sur_lab.analysis.scoring import agreement, exact_match, extract_answer, first_token_tv, score_example
from sur_lab.answer import Answer, AnswerBatch, check_cache_rows
from sur_lab.budget import check_budget
from sur_lab.cache_ops import cache_length, to_tensors
from sur_lab.checks import check_vocab
from sur_lab.edits import EditedContext
from sur_lab.executors import get_executor
from sur_lab.fingerprint import digest, dtype_reason
from sur_lab.models import LoadedModel
from sur_lab.repair import REFERENCE_OPERATORS, PreparedEdit, RepairResult, prepare, repair
from sur_lab.sweeps.record import NO_BUDGET, Record, check_meta, config_fields, record_key

#: Default :func:`run_case` ``eval_batch``: records answered together at most. 16 answers a whole NIAH default case
#: (4 references + 6 allocators x 2 budgets) in one batch; on the Qwen study model at 1K tokens its peak resident
#: memory stays under 6 GB (``scripts/bench_study_throughput.py`` measures it).
EVAL_BATCH = 16
#: Bytes of stacked pre-query caches a batch may hold: a chunk has at most ``EVAL_BATCH_BYTES // cache bytes`` rows
#: (at least one), so long contexts answer in smaller batches instead of running out of memory (2 GiB: 85 rows of a
#: 1K-token Qwen2.5-0.5B cache in float32, 2 rows at 32K).
EVAL_BATCH_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class Case:
    """One case of any study: an edit, its gold answers and the flat columns its records carry.

    Attributes:
        case_id: unique, stable identifier (part-file names derive from it).
        edit: the edit.
        gold: gold answers (for QA: the answer and its aliases; for NIAH: the ordered value list).
        meta: flat scalars copied into every record (dataset, placement, source_id, context_len, depth, ...).
        answer_ids: the canonical gold answer's token ids, teacher-forced after the query for ``gold_nll`` and
            ``gold_margin`` (e.g. :func:`sur_lab.analysis.endpoints.canonical_answer_ids`). ``None`` (default): derived
            by :func:`run_case` from ``gold[0]`` with :func:`~sur_lab.analysis.endpoints.canonical_answer_ids` (the
            query's decoded text deciding the leading space) when the case has gold answers and the sweep uses the
            default parser (gold answers are then answer strings, the first one canonical); otherwise the case has
            no answer target and those endpoints are NaN. ``()`` says explicitly that it has none.

    Raises:
        ValueError: (at construction) naming ``meta`` when a value is not a flat scalar or a key collides with a
            record field; naming ``answer_ids`` when it holds a negative or non-integer id.
    """

    case_id: str
    edit: EditedContext
    gold: tuple[str, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)
    answer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "gold", tuple(self.gold))
        object.__setattr__(self, "meta", {k: (v.item() if isinstance(v, np.generic) else v)
                                          for k, v in dict(self.meta).items()})
        check_meta(self.meta, self.case_id)
        if self.answer_ids is not None:
            ids = tuple(self.answer_ids)
            if not all(isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)) and int(i) >= 0
                       for i in ids):
                raise ValueError(f"case {self.case_id!r}: answer_ids must hold non-negative integer token ids; "
                                 f"got {ids!r}")
            object.__setattr__(self, "answer_ids", tuple(int(i) for i in ids))

    def fingerprint(self) -> str:
        """:func:`case_fingerprint` of this case's edit, gold answers, meta and explicit answer target (16 hex
        characters)."""
        return case_fingerprint(self.edit, self.gold, self.meta, self.answer_ids)

    def prepare(self, lm: LoadedModel) -> PreparedEdit:
        """What every method of the case starts from: the Dirty prefill and its Shift (:func:`sur_lab.repair.prepare`).

        A study whose stale cache is built otherwise (e.g. composed from separately cached documents) subclasses
        :class:`Case` and overrides this method.
        """
        return prepare(lm, self.edit)


def case_seed(seed: int, case_id: str) -> int:
    """The case-fixed seed passed to randomized allocators: a stable function of the sweep seed and ``case_id``."""
    return int(np.random.SeedSequence([int(seed), zlib.crc32(case_id.encode())]).generate_state(1)[0])


def case_fingerprint(edit: EditedContext, gold: Sequence[str] = (), meta: Mapping[str, Any] | None = None,
                     answer_ids: Sequence[int] | None = None) -> str:
    """A short hash of a case's content: the edit's tokens, span, query and relevance query, its text offsets and
    message containers (SUR's semantic units read them), the gold answers and meta copied into its records, and an
    explicit answer target (:attr:`Case.answer_ids`; a case without one hashes as before it existed).

    Guards resumed records against changed cases (16 hex characters).
    """
    h = hashlib.sha1()
    for part in (edit.original_ids, edit.query_ids, edit.relevance_ids):
        h.update(np.asarray(part, dtype=np.int64).tobytes())
        h.update(b"|")
    # A replacement's Dirty cache is the context before it (inserted_len); deletions keep their old fingerprints.
    span = f"{edit.prefix_len},{edit.deleted_len}" + (f",{edit.inserted_len}" if edit.inserted_len else "")
    h.update(span.encode())
    extra = {
        "offsets": list(edit.edited_offsets) if edit.edited_offsets is not None else None,
        "containers": list(edit.containers or ()),
        "text": edit.edited_text,
    }
    if gold or meta:
        extra.update(gold=list(gold), meta=dict(meta or {}))
    if answer_ids is not None:
        extra.update(answer_ids=[int(i) for i in answer_ids])
    h.update(digest(extra).encode())
    return h.hexdigest()[:16]


@runtime_checkable
class Method(Protocol):
    """A study's own method: neither a reference operator nor a registered allocator, yet dispatched like one.

    A study whose repairs are not an allocator at a budget (e.g. the non-prefix reuse study's repair units, with a
    ``"donor"`` protocol that copies rows from the reference cache) passes such objects among ``methods``; each is one
    record per case, with its own budget (NaN when it has none) and protocol. They must pickle (Ray).

    Attributes:
        name: the record's ``method`` (unique among the sweep's methods of the same protocol and budget).
        budget_pct: the record's ``budget_pct``, % of the suffix (NaN when the method has no budget).
        protocol: the record's ``protocol`` (``"forward"`` or ``"donor"``).
    """

    name: str
    budget_pct: float
    protocol: str

    def repair(self, lm: LoadedModel, prepared: PreparedEdit, *, executor: str, seed: int,
               options: Mapping[str, Any] | None) -> RepairResult:
        """The repaired pre-query cache (a new one: ``prepared`` is not modified), with its selection, timings
        (``select``, ``shift``, ``refresh``, ms) and allowance, as :func:`sur_lab.repair.repair` returns."""
        ...


def method_name(method: str | Method) -> str:
    """The record's ``method`` of a grid entry."""
    return method if isinstance(method, str) else method.name


def method_protocol(method: str | Method) -> str:
    """The record's ``protocol`` of a grid entry (``"forward"`` for references and allocators)."""
    return "forward" if isinstance(method, str) else method.protocol


def method_grid(methods: Sequence[str | Method], budgets: Sequence[float]) -> list[tuple[str | Method, float]]:
    """Cross allocator methods with budgets; reference methods appear once with a NaN budget, and :class:`Method`
    objects once with their own budget.

    Raises:
        ValueError: for an unknown method name, a budget outside [0, 100], or two entries with the same record key
            (name, budget, protocol) (before any work).
    """
    grid: list[tuple[str | Method, float]] = []
    for m in methods:
        if not isinstance(m, str):
            if not isinstance(m, Method):
                raise ValueError(f"methods must hold method names or Method objects; got {type(m).__name__}")
            budget = m.budget_pct
            grid.append((m, NO_BUDGET if budget is None or math.isnan(budget) else check_budget(budget)))
            continue
        if m in REFERENCE_OPERATORS:
            grid.append((m, NO_BUDGET))
            continue
        get_allocator(m)
        grid.extend((m, check_budget(b)) for b in budgets)
    keys = [record_key(method_name(m), b, method_protocol(m)) for m, b in grid]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"methods repeat the record {dup} (method, budget, protocol)")
    return grid


def check_run_args(cases: Sequence[Case], methods: Sequence[str | Method], budgets: Sequence[float], executor: str,
                   max_new_tokens: int, eval_batch: int) -> list[tuple[str | Method, float]]:
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


@dataclass(frozen=True)
class _Repaired:
    """What a record keeps of a repair once its cache went into a batch."""

    method: str
    budget: float
    protocol: str
    selection: Selection | None
    timings_ms: dict
    allowance: int
    cache_len: int
    note_tokens: int = 0
    note_template: str = ""


@dataclass
class _References:
    """The case's references: Re-prefill's answer (and parsed answer), Dirty's first-token logits and the gold
    answer target (empty when the case has none)."""

    reprefill: Answer | None = None
    parsed: Any = None
    dirty_logits: torch.Tensor | None = None
    gold_ids: tuple[int, ...] = ()


def answer_target(lm: LoadedModel, case: Case, parser: Callable[[str], Any] | None = None) -> tuple[int, ...]:
    """The token ids whose teacher-forced NLL is a record's ``gold_nll``: :attr:`Case.answer_ids` when given, else
    :func:`~sur_lab.analysis.endpoints.canonical_answer_ids` of ``case.gold[0]`` after the decoded query when the case
    has gold answers, the model a tokenizer and the sweep the default ``parser`` (None); else ``()`` (no target)."""
    if case.answer_ids is not None:
        return case.answer_ids
    if not case.gold or parser is not None or lm.tokenizer is None or not str(case.gold[0]).strip():
        return ()
    query = lm.tokenizer.decode(case.edit.query_ids.tolist(), skip_special_tokens=False)
    return tuple(canonical_answer_ids(lm.tokenizer, str(case.gold[0]), query))


def make_scorer(cases: Sequence[Any]):
    """A ``scorer(sweep_case, answer_text) -> bool`` for :func:`sur_lab.sweeps.run_sweep`.

    ``cases`` are a study's QA cases, each with a ``case_id`` and an ``example`` (a :class:`sur_lab.data.qa.QAExample`);
    a sweep case's id may add a trial suffix ``"#t{trial}"``, which is dropped to find its example.

    It extracts the answer once (:func:`sur_lab.analysis.scoring.extract_answer`) and applies the example's dataset rule
    (:func:`sur_lab.analysis.scoring.score_example`: HotpotQA string EM, 2Wiki and MuSiQue over aliases, IIRC with DROP
    normalization and span matching, including "none" and yes/no answers).
    """
    examples = {c.case_id: c.example for c in cases}

    def scorer(sweep_case, text: str) -> bool:
        base = re.sub(r"#t\d+$", "", sweep_case.case_id)
        return score_example(extract_answer(text), examples[base])

    return scorer


def _targets(lm: LoadedModel, case: Case, refs: _References) -> dict[str, list[int]]:
    """Token sequences teacher-forced after the query for every row, by name (scored in one batched forward each by
    :meth:`sur_lab.answer.AnswerBatch.score`)."""
    return {"reprefill": reference_continuation(refs.reprefill.token_ids), "gold": list(refs.gold_ids)}


def _endpoints(case: Case, ans: Answer, logprobs: Mapping[str, np.ndarray], refs: _References,
               scorer: Callable[[Case, str], bool] | None, parser: Callable[[str], Any] | None) -> dict[str, Any]:
    """Every endpoint field of a record, from this row's answer (text, token ids, first-token logits), its
    teacher-forced log-probabilities by target name, and the case's references."""
    ref = refs.reprefill
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
    tv = first_token_tv(ans.first_token_logits, ref.first_token_logits)
    tv_dirty = (first_token_tv(refs.dirty_logits, ref.first_token_logits) if refs.dirty_logits is not None
                else float("nan"))
    continuation = logprobs["reprefill"]
    gold = logprobs["gold"]
    gold_token = case.meta.get("gold_token")
    if gold_token is None and refs.gold_ids:
        gold_token = refs.gold_ids[0]
    margin = gold_margin(ans.first_token_logits, int(gold_token)) if gold_token is not None else float("nan")
    old_token = case.meta.get("old_token")
    pull = (old_margin(ans.first_token_logits, int(old_token), int(gold_token))
            if old_token is not None and gold_token is not None else float("nan"))
    return {
        "prediction": _as_text(parsed),
        "em": em,
        "agree_reprefill": bool(_same(parsed, refs.parsed) if parser is not None else agreement(parsed, refs.parsed)),
        "sequence_agree": sequence_agree(ans.token_ids, ref.token_ids),
        "tv_reprefill": tv,
        "tv_dirty_reprefill": tv_dirty,
        "nr_tv": nr_tv(min(tv, 1.0), min(tv_dirty, 1.0)) if not math.isnan(tv_dirty) else float("nan"),
        "nll_reprefill": float(-continuation.sum()) if continuation.size else float("nan"),
        "nll_tokens": int(continuation.size),
        "jsd_reprefill": first_token_jsd(ans.first_token_logits, ref.first_token_logits),
        "argmax_agree": argmax_agree(ans.first_token_logits, ref.first_token_logits),
        "logits_identical": logits_identical(ans.first_token_logits, ref.first_token_logits),
        "logits_digest": logits_digest(ans.first_token_logits),
        # Eq. of endpoints.gold_nll on the batch's teacher-forced log-probabilities (float64 log-softmax).
        "gold_nll": float(-gold.mean()) if gold.size else float("nan"),
        "gold_tokens": int(gold.size),
        "gold_margin": margin,
        "old_margin": pull,
    }


def _chunks(rows: list, size: int) -> list[list]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def _chunk_rows(prepared: PreparedEdit, eval_batch: int) -> int:
    """Rows per batch: ``eval_batch``, fewer when that many copies of the case's largest cache would pass
    :data:`EVAL_BATCH_BYTES` (a deterministic function of the case, so a resumed case batches the same way)."""
    biggest = prepared.dirty_cache if prepared.dirty_cache is not None else prepared.shift_cache
    row_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in to_tensors(biggest))
    return max(1, min(eval_batch, EVAL_BATCH_BYTES // max(row_bytes, 1)))


def run_case(
    lm: LoadedModel,
    case: Case,
    methods: Sequence[str | Method],
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
    share_prefix: bool = True,
) -> list[Record]:
    """Repair ``case`` with every (method, budget) of the grid, answer the query, score, and return the records.

    The case is prepared once (:meth:`Case.prepare`). Re-prefill and Dirty are always answered (their answers define
    every record's endpoints), first. Records are made in chunks of at most ``eval_batch``: each chunk's repairs run one
    at a time (timed: select, shift, refresh), then its caches are answered together (:class:`sur_lab.answer.
    AnswerBatch`: one query forward, greedy decoding with per-row stopping, and the teacher-forced NLL of
    Re-prefill's continuation), so at most ``eval_batch`` repaired caches are alive at once. The chunks are cut from
    the whole grid whatever ``skip`` holds (a chunk whose records are all skipped is not run; the others are answered
    whole and their skipped rows dropped), so a resumed case's records equal an uninterrupted run's bit for bit on
    the same machine.

    Timing honesty: answer timings (``query_ms``, ``decode_ms``, ``answer_ms`` and so ``latency_ms``, Eq. 20) are never
    taken from a batched pass. A ``timed`` case (and every case at ``eval_batch=1``) is answered one record at a time
    (a batch of one makes :func:`sur_lab.answer.greedy_answer`'s forwards), so its timings are per request; the other
    cases are answered in batches and their answer timings are NaN. :attr:`Record.timed` says which.

    Args:
        lm: the model.
        case: the case.
        methods: reference operators (one record each, budget NaN), allocator names (one record per budget) and
            :class:`Method` objects (one record each).
        budgets: budgets b in [0, 100], % of the suffix.
        executor: sparse-refresh executor name.
        max_new_tokens: greedy decoding limit, tokens (EOS-aware).
        eval_batch: records answered together at most (1: each record alone, the per-record path). Memory grows with
            it: about ``eval_batch`` copies of the pre-query cache plus the decoded rows; a batch never holds more
            than :data:`EVAL_BATCH_BYTES` of caches (fewer rows on long contexts).
        timed: answer every record of the case alone, timed (per request, Eq. 20); its quality endpoints then come
            from that per-record pass too.
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
        share_prefix: exact prefix sharing inside the case (:attr:`sur_lab.repair.PreparedEdit.share_prefix`): Replay's
            suffix forward on the Dirty prefill's valid prefix runs once and serves Replay, the allocators at
            B = S and Re-prefill. Never for a timed case (Re-prefill's latency is a rebuild from empty). Recorded
            as :attr:`Record.shared_prefix`.

    Returns:
        The records made, in grid order.

    Raises:
        ValueError: for an unknown method or executor, a budget outside [0, 100], ``max_new_tokens`` /
            ``eval_batch`` < 1, or an answer target (:func:`answer_target`) with an id outside the vocabulary (before
            any model call).
    """
    grid = check_run_args([case], methods, budgets, executor, max_new_tokens, eval_batch)
    skip = set(skip)
    todo = [(m, b) for m, b in grid if _key(m, b) not in skip]
    if not todo:
        return []
    edit = case.edit
    gold_ids = answer_target(lm, case, parser)
    check_vocab(torch.tensor(gold_ids, dtype=torch.long), lm.spec.vocab_size, f"case {case.case_id!r} answer_ids")
    config = config_fields(lm, seed=seed, executor=executor, max_new_tokens=max_new_tokens, eval_batch=eval_batch,
                           options=options)
    prepared = case.prepare(lm)
    seed_c = case_seed(seed, case.case_id)
    per_request = bool(timed) or eval_batch == 1
    prepared.share_prefix = shared_prefix(share_prefix, per_request)
    base = {
        **config, "case_id": case.case_id, "case_seed": seed_c, "case_fingerprint": case.fingerprint(),
        "workers": int(workers), "threads": torch.get_num_threads(), "timed": per_request, "meta": case.meta,
        "shared_prefix": prepared.share_prefix, "dtype_reason": dtype_reason(lm),
        "prefix_len": edit.prefix_len, "deleted_len": edit.deleted_len, "suffix_len": edit.suffix_len,
        "gold": case.gold, "dirty_ms": prepared.dirty_ms,
    }
    wanted = {_key(m, b) for m, b in todo}
    # The references first: every record's endpoints compare with Re-prefill (and Dirty, Eq. 14's normaliser).
    references = [("Re-prefill", NO_BUDGET)] + ([("Dirty", NO_BUDGET)] if prepared.dirty_cache is not None else [])
    # The whole grid, stored rows included: a batch's composition (and so every float it answers, bit for bit) must
    # not depend on what a previous run stored; stored rows are dropped after the fact (resume determinism).
    rows = references + [(m, b) for m, b in grid if _key(m, b) not in {_key(*r) for r in references}]
    refs = _References(gold_ids=gold_ids)
    pending: list = []
    made: dict[tuple, Record] = {}
    nan_timings = {"query": float("nan"), "decode": float("nan"), "answer": float("nan")}
    # A timed case is answered one record at a time: latency (Eq. 20) is per request, never from a batched pass.
    for chunk in _chunks(rows, 1 if per_request else _chunk_rows(prepared, int(eval_batch))):
        emitted = [_key(m, b) in wanted for m, b in chunk]
        needed = ((refs.reprefill is None and any(m == "Re-prefill" for m, _ in chunk))
                  or (refs.dirty_logits is None and any(m == "Dirty" for m, _ in chunk)))
        if not any(emitted) and not needed:
            continue  # every record of this batch is stored: nothing to answer
        results = [repair(lm, prepared, m, b, executor=executor, seed=seed_c, options=options) if isinstance(m, str)
                   else m.repair(lm, prepared, executor=executor, seed=seed_c, options=options) for m, b in chunk]
        kept = [_Repaired(method_name(m), b, method_protocol(m), r.selection, r.timings_ms, r.allowance,
                          cache_length(r.cache), r.note_tokens, r.note_template) for (m, b), r in zip(chunk, results)]
        for row, r in zip(kept, results):
            check_cache_rows(r.cache, edit, name=f"the {row.method} cache", note_tokens=r.note_tokens)
        batch = AnswerBatch(lm, [r.cache for r in results], edit.query_ids, copy=False)
        del results  # their caches were consumed by the batch
        needs_answer = [e or m == "Re-prefill" for e, (m, _) in zip(emitted, chunk)]
        answers = batch.decode(max_new_tokens) if any(needs_answer) else [None] * len(chunk)
        for (m, _), ans, i in zip(chunk, answers, range(len(chunk))):
            if m == "Re-prefill" and refs.reprefill is None:
                refs.reprefill = ans
                refs.parsed = parser(ans.text) if parser is not None else extract_answer(ans.text)
            if m == "Dirty" and refs.dirty_logits is None:
                refs.dirty_logits = batch.first_token_logits[i]
        if any(emitted):
            scores = {name: batch.score(ids) for name, ids in _targets(lm, case, refs).items()}
            for i, (row, ans, e) in enumerate(zip(kept, answers, emitted)):
                if e:
                    timing = ans.timings_ms if per_request else nan_timings
                    pending.append((row, ans, {name: lp[i] for name, lp in scores.items()}, timing))
        del batch
        if prepared.dirty_cache is not None and refs.dirty_logits is None:
            continue  # eval_batch = 1: the records wait for Dirty's logits (the next chunk)
        for row, ans, logprobs, timing in pending:
            record = _record(base, row, ans, timing, _endpoints(case, ans, logprobs, refs, scorer, parser))
            if emit is not None:
                emit(record)
            made[record.key] = record
        pending = []
    return [made[_key(m, b)] for m, b in todo]


def shared_prefix(share_prefix: bool, timed: bool) -> bool:
    """A case's :attr:`Record.shared_prefix`: sharing is asked for and the case is not timed per request (``timed``
    already includes ``eval_batch == 1``)."""
    return bool(share_prefix) and not bool(timed)


def _key(method: str | Method, budget: float) -> tuple[str, str, str]:
    return record_key(method_name(method), budget, method_protocol(method))


def grid_keys(methods: Sequence[str | Method], budgets: Sequence[float]) -> list[tuple[str, str, str]]:
    """The record keys (:func:`sur_lab.sweeps.record.record_key`) of the grid of ``methods`` x ``budgets``, in grid
    order.

    Raises:
        ValueError: as :func:`method_grid`.
    """
    return [_key(m, b) for m, b in method_grid(methods, budgets)]


def _record(base: dict, row: _Repaired, ans: Answer, timing: Mapping[str, float], endpoints: dict) -> Record:
    """The record of one answered repair: its support, timings and answer, and its endpoints."""
    sel, t = row.selection, row.timings_ms
    support = sel.support if sel is not None else None
    return Record(
        **base,
        method=row.method,
        budget_pct=float(row.budget),
        protocol=row.protocol,
        cache_len=row.cache_len,
        allowance=int(row.allowance),
        num_intervals=support.num_intervals if support is not None else (1 if row.allowance else 0),
        positions=tuple(support.positions.tolist()) if support is not None else (),
        intervals=tuple(tuple(iv) for iv in support.intervals) if support is not None else (),
        extra_forward_tokens=int(sel.extra_forward_tokens) if sel is not None else 0,
        extra_forward_layers=int(sel.diagnostics.get("extra_forward_layers", 0)) if sel is not None else 0,
        # SUR / SUR-IDF: units tied after rounding (appendix 7.3 tie rule); None for allocators without unit ranks.
        tied_units=sel.diagnostics.get("tied_units") if sel is not None else None,
        note_tokens=row.note_tokens,
        note_template=row.note_template,
        select_ms=t["select"],
        shift_ms=t["shift"],
        refresh_ms=t["refresh"],
        query_ms=timing["query"],
        decode_ms=timing["decode"],
        answer_ms=timing["answer"],
        latency_ms=t["select"] + t["shift"] + t["refresh"] + timing["answer"],
        answer=ans.text,
        finished=bool(ans.finished),
        **endpoints,
    )


__all__ = ["EVAL_BATCH", "EVAL_BATCH_BYTES", "Case", "Method", "answer_target", "grid_keys", "method_name", "method_protocol", "case_fingerprint", "case_seed", "check_run_args", "make_scorer", "method_grid", "run_case", "shared_prefix"]
