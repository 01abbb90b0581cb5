"""Running notebook 10's traces: the paths that keep a cache in step with the prompt (:class:`TracePath`,
:func:`default_paths`), one trace followed by every path (:func:`run_trace`), many (:func:`run_traces`) with their
cumulative cost (:func:`add_cumulative`), and what a stored trace's rows depend on besides the trace
(:func:`_fingerprint`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from sur_lab.analysis.scoring import agreement, exact_match, extract_answer
from sur_lab.answer import AnswerBatch
from sur_lab.fingerprint import model_fingerprint, versions
from sur_lab.models import LoadedModel
from sur_lab.session import EditSession
from sur_lab.studies.agent_traces.cases import query_text
from sur_lab.studies.agent_traces.design import PREFIX, REFERENCE, SHIFT
from sur_lab.sync import SyncPolicy

__all__ = ["TracePath", "default_paths", "run_trace", "run_traces", "add_cumulative"]


@dataclass(frozen=True)
class TracePath:
    """One way of keeping the cache in step with the prompt.

    Attributes:
        label: display name (``"sync 5%"``).
        method: the session's method (``"SUR"``, ``"Shift"`` or ``"Re-prefill"``).
        budget_pct: b, % of the stale rows (NaN for prefix reuse and re-prefill; 0 for Shift).
        policy: the :class:`~sur_lab.sync.SyncPolicy` of its syncs.
    """

    label: str
    method: str
    budget_pct: float
    policy: SyncPolicy


def default_paths(budgets: Sequence[float] = (2, 5, 10)) -> list[TracePath]:
    """sync at each budget (always repairing), sync 0 % (Shift), prefix reuse and re-prefill, in that order.

    Raises:
        ValueError: naming ``budgets`` when empty or a budget is outside (0, 100].
    """
    if not len(budgets):
        raise ValueError("budgets is empty; give at least one budget in (0, 100]")
    for b in budgets:
        if not 0 < float(b) <= 100:
            raise ValueError(f"budgets holds {b!r}; each budget must lie in (0, 100] (0 % is the Shift path)")
    always = SyncPolicy(0, 1.0)
    paths = [TracePath(f"sync {float(b):g}%", "SUR", float(b), always) for b in budgets]
    paths.append(TracePath(SHIFT, "Shift", 0.0, always))
    paths.append(TracePath(PREFIX, "SUR", float("nan"), SyncPolicy(min_stale_rows=2**62)))
    paths.append(TracePath(REFERENCE, "Re-prefill", float("nan"), always))
    return paths



def _region(rec) -> str:
    if rec.stale_rows == 0:
        return "append"
    return "first half" if rec.first_change < rec.previous_tokens / 2 else "second half"


def run_trace(lm: LoadedModel, trace: Mapping[str, Any], paths: Sequence[TracePath], *, executor: str = "packed",
              max_new_tokens: int = 8, seed: int = 0) -> list[dict]:
    """Follow one trace's prompts with every path; one row per (turn, path).

    Turn 0 is the first prefill (every path prefills the prompt whole). Where the first change lies is measured in the
    cached prompt (the previous turn's): ``first_change_frac`` = first change / previous tokens, and ``region`` is
    ``"append"`` (no cached row after it), ``"first half"`` or ``"second half"`` of the cached prompt. Per turn each
    path, one request at a time, syncs its session to the turn's prompt and forwards the turn's question after it
    (:meth:`~sur_lab.session.EditSession.forward_query`), both timed: TTFT = sync + query forward, ms, a per-request
    latency. The rest of the greedy answers (a quality endpoint) is then decoded for all paths together from those
    query forwards (:meth:`sur_lab.answer.AnswerBatch.queried`; ``answer_batch`` rows): each first token is the
    unbatched one, later tokens equal an unbatched decode up to a batched forward's rounding. Re-prefill's answer is
    the reference the others are scored against.

    Returns:
        Rows with ``trace, turn, edits, path, method, budget_pct, sync_path, tokens, first_change, first_change_frac,
        region, deleted, inserted, reused, rerotated, recomputed, stale_rows, allowance, sync_ms, query_ms, ttft_ms,
        answer_batch, kind, known, plan_format, prediction, em, agree, token_exact, debt``: ``kind``, ``known`` and
        ``plan_format`` are the turn's question kind, whether its gold is an answer (not "unknown") and whether the
        revised plan's answer format is in force (:func:`build_trace`); ``em`` is normalized exact match against the
        turn's gold (:func:`~sur_lab.analysis.scoring.exact_match`; the format prefix and "unknown" are part of it).

    Raises:
        ValueError: naming ``paths`` when re-prefill is missing or labels repeat.
    """
    labels = [p.label for p in paths]
    if REFERENCE not in labels or len(set(labels)) != len(labels):
        raise ValueError(f"paths must have unique labels and include {REFERENCE!r}; got {labels}")
    order = sorted(paths, key=lambda p: p.label != REFERENCE)
    sessions = {p.label: EditSession(lm, method=p.method, budget_pct=0.0 if math.isnan(p.budget_pct) else p.budget_pct,
                                     executor=executor, seed=seed, sync_policy=p.policy) for p in paths}
    rows = []
    for t, turn in enumerate(trace["turns"]):
        query = query_text(lm.tokenizer, turn["messages"], turn["question"])
        query_ids = torch.tensor(lm.tokenizer(query, add_special_tokens=False)["input_ids"], dtype=torch.long)
        synced, caches, firsts = [], [], []
        for p in order:  # one request at a time: the sync and the query forward are timed per request (TTFT)
            session = sessions[p.label]
            t0 = time.perf_counter()
            rec = session.sync(turn["messages"])
            sync_ms = (time.perf_counter() - t0) * 1e3
            first, cache = session.forward_query(query_ids)
            synced.append((p, rec, sync_ms, first.timings_ms["query"], session.debt))
            caches.append(cache)
            firsts.append(first.first_token_logits)
        # The rest of the answers is a quality endpoint: decoded together from the per-request query forwards.
        answers = AnswerBatch.queried(lm, caches, query_ids, torch.stack(firsts), copy=False).decode(max_new_tokens)
        ref = answers[0]  # re-prefill's (first in ``order``)
        ref_parsed = extract_answer(ref.text)
        for (p, rec, sync_ms, query_ms, debt), ans in zip(synced, answers):
            prediction = extract_answer(ans.text)
            rows.append({
                "trace": trace["id"], "turn": t, "edits": turn["edits"], "path": p.label, "method": p.method,
                "budget_pct": p.budget_pct, "sync_path": rec.path, "tokens": rec.num_tokens,
                "first_change": rec.first_change, "first_change_frac": rec.first_change / max(1, rec.previous_tokens),
                "region": _region(rec) if t else "prefill", "deleted": rec.deleted, "inserted": rec.inserted,
                "reused": rec.reused, "rerotated": rec.rerotated, "recomputed": rec.recomputed,
                "stale_rows": rec.stale_rows, "allowance": rec.allowance, "sync_ms": sync_ms,
                "query_ms": query_ms, "ttft_ms": sync_ms + query_ms, "answer_batch": len(answers),
                "kind": turn.get("kind", "new"), "known": bool(turn.get("known", True)),
                "plan_format": bool(turn.get("format", False)),
                "prediction": prediction, "em": bool(exact_match(prediction, turn["answers"])),
                "agree": bool(agreement(prediction, ref_parsed)),
                "token_exact": list(ans.token_ids) == list(ref.token_ids), "debt": debt,
            })
    return rows


def run_traces(lm: LoadedModel, traces: Sequence[Mapping[str, Any]], paths: Sequence[TracePath], *,
               executor: str = "packed", max_new_tokens: int = 8, seed: int = 0, progress: bool = True) -> pd.DataFrame:
    """:func:`run_trace` over ``traces``; one DataFrame with cumulative cost columns.

    Added columns: ``cum_recomputed`` and ``cum_ttft_ms`` (sums over the trace's turns so far, the first prefill
    included) and ``cost_ratio`` (cumulative tokens recomputed over re-prefill's at the same turn).
    """
    rows = []
    for trace in tqdm(traces, desc="traces", disable=not progress):
        rows += run_trace(lm, trace, paths, executor=executor, max_new_tokens=max_new_tokens, seed=seed)
    return add_cumulative(pd.DataFrame(rows))


def add_cumulative(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``cum_recomputed``, ``cum_ttft_ms`` and ``cost_ratio`` (see :func:`run_traces`)."""
    df = df.copy()
    grouped = df.groupby(["trace", "path"], sort=False)
    df["cum_recomputed"] = grouped["recomputed"].cumsum()
    df["cum_ttft_ms"] = grouped["ttft_ms"].cumsum()
    ref = df[df["path"] == REFERENCE].set_index(["trace", "turn"])["cum_recomputed"]
    df["cost_ratio"] = df["cum_recomputed"].to_numpy() / ref.loc[list(zip(df["trace"], df["turn"]))].to_numpy()
    return df


def _fingerprint(lm, p: Mapping[str, Any], seed: int, executor: str) -> dict:
    """What every stored row depends on besides its trace (:meth:`sur_lab.sweeps.SweepStore.run_keyed`)."""
    return {**model_fingerprint(lm), "params": dict(p), "seed": int(seed), "executor": executor,
            "versions": versions()}
