"""Numerical execution-path controls: how much Replay and Re-prefill disagree beyond repeat noise (appendix 11).

Replay (the valid prefix cache plus a recompute of the suffix) and Re-prefill (a prefill of the whole edited prompt)
describe the same edited history, but compute it with different shapes, so their logits can differ numerically.
Per cell (one evidence-location case, :mod:`sur_lab.studies.evidence_location`) this study runs:

- ``shared``: three decodes from one shared Re-prefill cache (decoder reuse);
- ``reprefill``: three independently built Re-prefill caches, one decode each;
- ``replay``: three independently built Replay caches (each from its own Dirty prefill), one decode each;

and records, per decode, the generated ids, the first-logit float32 bytes (as a SHA-256), the argmax and the
gold-answer NLL (:func:`sur_lab.analysis.endpoints.gold_nll`, teacher-forced from the same cache).

Per cell and output (``sequence``, ``exact_logits``, ``argmax``): the within-condition agreement of Eq. 13,
``A_within(v) = 1/3 sum_{i<j} 1[v_i = v_j]``; the cross-path agreement ``A_cross``, the mean over the nine
Replay-Re-prefill pairs; and the unclipped excess disagreement ``A_within(Re-prefill) - A_cross``. For the NLL: the
median of the nine cross-path ``|dNLL|`` minus the median of the three within-Re-prefill ``|dNLL|``. Table 17 reports
them as disagreement percentages averaged over cells (:func:`table17`, :func:`nll_table`).

The table functions are pure (records in, tables out); :func:`run_cell` and :func:`run` use the core operators
(:func:`sur_lab.executors.reprefill`, :func:`sur_lab.executors.replay`, :func:`sur_lab.answer.answer`) directly; given
a folder, :func:`run` stores its rows through the one sweep store (keyed rows of
:meth:`sur_lab.sweeps.SweepStore.run_keyed`, a cell per case) and resumes finished cells.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from sur_lab.analysis.endpoints import gold_nll, logits_digest, sequence_agree
from sur_lab.answer import answer
from sur_lab.cache_ops import clone_cache
from sur_lab.edits import EditedContext
from sur_lab.executors import dirty, replay, reprefill
from sur_lab.fingerprint import device_name, model_fingerprint, versions
from sur_lab.forward import forward_tokens
from sur_lab.models import LoadedModel
from sur_lab.sweeps.case import case_fingerprint
from sur_lab.sweeps.store import SweepStore

#: The three conditions of a cell (appendix 11).
CONDITIONS = ("shared", "reprefill", "replay")
#: Categorical outputs compared, as named in Table 17 ("Sequence", "Exact logits", "Argmax").
OUTPUTS = ("sequence", "exact_logits", "argmax")
#: Decodes per condition (appendix 11: three).
REPEATS = 3
#: The table :func:`run` writes in its ``out`` folder.
TABLE_FILE = "decodes.parquet"
#: Record columns that identify a cell.
CELL_KEYS = ("model", "dtype", "device", "case_id")
#: Study sizes. Cells are evidence-location cases (four per source; the caller builds them with
#: :func:`sur_lab.studies.evidence_location.build_panel` from ``datasets``, ``geometry`` and
#: ``sources_per_dataset``, as notebook 05 does, since no study imports another); the paper ran 40 sources (160 cells) per model
#: in BF16 on GPUs. ``default`` runs 16 cells in float32 and bfloat16 on the CPU, on the model it is given (notebook 05:
#: the embedded SmolLM2, its ``model_name`` default).
PRESETS = {
    "smoke": {"datasets": ["hotpotqa"], "sources_per_dataset": 1, "geometry": "smoke", "dtypes": ["float32"],
              "max_new_tokens": 4},
    "default": {"datasets": ["2wikimultihopqa", "hotpotqa", "iirc", "musique"], "sources_per_dataset": 1,
                "geometry": "quarter", "dtypes": ["float32", "bfloat16"], "max_new_tokens": 16},
    "paper": {"datasets": ["2wikimultihopqa", "hotpotqa", "iirc", "musique"], "sources_per_dataset": 10,
              "geometry": "paper", "dtypes": ["bfloat16"], "max_new_tokens": 64},
}


# ---------------------------------------------------------------------------------------------------------------------
# Agreement (Eq. 13) and its cross-path analogue: pure functions


def _check_values(values: Sequence, name: str, minimum: int) -> list:
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of outputs, not one string")
    out = list(values)
    if len(out) < minimum:
        raise ValueError(f"{name} needs at least {minimum} outputs; got {len(out)}")
    return out


def _eq(a: Any, b: Any) -> bool:
    return bool(a == b) if not isinstance(a, (list, tuple, np.ndarray)) else sequence_agree(a, b)


def a_within(values: Sequence, same: Callable[[Any, Any], bool] = _eq) -> float:
    """Within-condition agreement (Eq. 13): the fraction of agreeing pairs among k >= 2 repeated outputs.

    ``A_within(v) = 1/C(k,2) sum_{i<j} 1[v_i = v_j]``; for the paper's k = 3 this is ``1/3 sum_{i<j} 1[v_i = v_j]``:
    1 when all three agree, 1/3 when exactly two do, 0 when all differ.

    Args:
        values: the k outputs (token-id sequences, logit digests, argmax ids, ...).
        same: equality of two outputs (default: token-id sequences by :func:`sur_lab.analysis.endpoints.
            sequence_agree`, anything else by ``==``).

    Returns:
        Agreement in [0, 1].

    Raises:
        ValueError: naming ``values`` when it holds fewer than 2 outputs or is a string.
    """
    v = _check_values(values, "values", 2)
    pairs = list(itertools.combinations(range(len(v)), 2))
    return sum(same(v[i], v[j]) for i, j in pairs) / len(pairs)


def a_cross(a_values: Sequence, b_values: Sequence, same: Callable[[Any, Any], bool] = _eq) -> float:
    """Cross-path agreement: the fraction of agreeing pairs over all ``len(a) x len(b)`` pairs (nine for 3 x 3).

    Raises:
        ValueError: naming ``a_values``/``b_values`` when empty or a string.
    """
    a = _check_values(a_values, "a_values", 1)
    b = _check_values(b_values, "b_values", 1)
    return sum(same(x, y) for x in a for y in b) / (len(a) * len(b))


def nll_differences(reprefill_nll: Sequence[float], replay_nll: Sequence[float]) -> dict[str, float]:
    """The cell-level NLL analogue of the excess disagreement (appendix 11), in nats.

    ``within`` = median of the ``C(k,2)`` absolute differences between Re-prefill repeats (three for k = 3), ``cross``
    = median of the ``k x k`` absolute Replay-Re-prefill differences (nine), ``excess = cross - within`` (unclipped).

    Raises:
        ValueError: naming ``reprefill_nll`` (fewer than 2) or ``replay_nll`` (empty), or when a value is not finite.
    """
    rp = np.asarray(_check_values(reprefill_nll, "reprefill_nll", 2), dtype=np.float64)
    rl = np.asarray(_check_values(replay_nll, "replay_nll", 1), dtype=np.float64)
    if not (np.all(np.isfinite(rp)) and np.all(np.isfinite(rl))):
        raise ValueError("reprefill_nll and replay_nll must be finite")
    within = float(np.median([abs(rp[i] - rp[j]) for i, j in itertools.combinations(range(rp.size), 2)]))
    cross = float(np.median(np.abs(rl[:, None] - rp[None, :])))
    return {"within": within, "cross": cross, "excess": cross - within}


_OUTPUT_COLUMNS = {"sequence": "token_ids", "exact_logits": "logits_sha256", "argmax": "argmax"}


def cell_table(records: pd.DataFrame | Sequence[dict]) -> pd.DataFrame:
    """Per-cell agreements from :func:`run` records: one row per (model, dtype, device, case_id).

    Columns, for each output o in :data:`OUTPUTS`: ``within_shared_o``, ``within_reprefill_o``, ``within_replay_o``
    (Eq. 13), ``cross_o`` (nine Replay-Re-prefill pairs), ``excess_o = within_reprefill_o - cross_o`` (unclipped);
    and ``nll_within``, ``nll_cross``, ``nll_excess`` (:func:`nll_differences`). Cell columns of the records
    (``dataset``, ``source_id``, ``cell``) are kept.

    Raises:
        ValueError: naming ``records`` when a column is missing or a cell lacks a condition or has fewer than two
            repeats of one.
    """
    df = pd.DataFrame(records)
    need = [*CELL_KEYS, "condition", "repeat", "gold_nll", *_OUTPUT_COLUMNS.values()]
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ValueError(f"records lack columns {missing}")
    extra = [c for c in ("dataset", "source_id", "cell") if c in df.columns]
    rows = []
    for key, g in df.groupby(list(CELL_KEYS), sort=True):
        by = {c: g[g["condition"] == c].sort_values("repeat") for c in CONDITIONS}
        short = [c for c, rows_c in by.items() if len(rows_c) < 2]
        if short:
            raise ValueError(f"records: cell {key} has fewer than two repeats of {short}")
        row = dict(zip(CELL_KEYS, key))
        row.update({c: g[c].iloc[0] for c in extra})
        for out, col in _OUTPUT_COLUMNS.items():
            vals = {c: [tuple(v) if isinstance(v, (list, np.ndarray)) else v for v in by[c][col]] for c in CONDITIONS}
            for c in CONDITIONS:
                row[f"within_{c}_{out}"] = a_within(vals[c])
            row[f"cross_{out}"] = a_cross(vals["replay"], vals["reprefill"])
            row[f"excess_{out}"] = row[f"within_reprefill_{out}"] - row[f"cross_{out}"]
        nll = nll_differences(by["reprefill"]["gold_nll"].tolist(), by["replay"]["gold_nll"].tolist())
        row.update({f"nll_{k}": v for k, v in nll.items()})
        rows.append(row)
    return pd.DataFrame(rows)


def table17(cells: pd.DataFrame) -> pd.DataFrame:
    """Table 17's categorical part from :func:`cell_table`: disagreement percentages averaged over cells.

    One row per (model, dtype, device, output): ``shared_pct = 100 (1 - mean A_within(shared))``,
    ``reprefill_pct = 100 (1 - mean A_within(Re-prefill))``, ``cross_pct = 100 (1 - mean A_cross)``,
    ``excess_pp = 100 mean(A_within(Re-prefill) - A_cross)`` (percentage points, unclipped; equals
    ``cross_pct - reprefill_pct``), ``replay_pct`` (Replay's own repeat disagreement) and ``cells``.
    """
    rows = []
    for key, g in cells.groupby(["model", "dtype", "device"], sort=False):
        for out in OUTPUTS:
            rows.append({
                "model": key[0], "dtype": key[1], "device": key[2], "output": out,
                "shared_pct": 100 * (1 - g[f"within_shared_{out}"].mean()),
                "reprefill_pct": 100 * (1 - g[f"within_reprefill_{out}"].mean()),
                "cross_pct": 100 * (1 - g[f"cross_{out}"].mean()),
                "excess_pp": 100 * g[f"excess_{out}"].mean(),
                "replay_pct": 100 * (1 - g[f"within_replay_{out}"].mean()),
                "cells": len(g),
            })
    return pd.DataFrame(rows)


def nll_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Table 17's NLL part from :func:`cell_table`: per (model, dtype, device) the mean over cells of the cell-level
    within-Re-prefill median ``|dNLL|``, the cross-path median ``|dNLL|`` and their difference (nats)."""
    g = cells.groupby(["model", "dtype", "device"], sort=False)
    out = g[["nll_within", "nll_cross", "nll_excess"]].mean().reset_index()
    return out.assign(cells=g.size().to_numpy())


# ---------------------------------------------------------------------------------------------------------------------
# Running the paths (core operators)


@torch.inference_mode()
def teacher_forced_logits(lm: LoadedModel, cache, edit: EditedContext, answer_ids: Sequence[int]) -> torch.Tensor:
    """``(T, V)`` logits predicting each of the T answer tokens after the query, from a clone of ``cache``.

    Row 0 follows the query; row t follows the query and ``answer_ids[:t]`` (teacher forcing). ``cache`` (the
    pre-query cache of any path, ``p + S`` rows) is not modified.

    Raises:
        ValueError: naming ``answer_ids`` when empty.
    """
    ids = torch.as_tensor(list(answer_ids), dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("answer_ids is empty")
    work = clone_cache(cache)
    tokens = torch.cat((edit.query_ids, ids[:-1]))
    return forward_tokens(lm, tokens, work, logits="all")[-ids.numel():]


def _decode_record(lm: LoadedModel, cache, edit: EditedContext, answer_ids, max_new_tokens: int) -> dict[str, Any]:
    ans = answer(lm, cache, edit, max_new_tokens=max_new_tokens)
    logits = ans.first_token_logits
    return {
        "token_ids": list(ans.token_ids),
        "text": ans.text,
        "finished": ans.finished,
        "argmax": int(torch.argmax(logits)),
        "logits_sha256": logits_digest(logits),
        "gold_nll": gold_nll(teacher_forced_logits(lm, cache, edit, answer_ids), answer_ids),
    }


def run_cell(
    lm: LoadedModel, edit: EditedContext, answer_ids: Sequence[int], *, repeats: int = REPEATS,
    max_new_tokens: int = 16,
) -> list[dict[str, Any]]:
    """The three conditions of one cell: ``repeats`` decodes each (appendix 11).

    ``shared``: one Re-prefill cache, ``repeats`` decodes from it (each on a clone). ``reprefill``: ``repeats``
    independent Re-prefill prefills. ``replay``: ``repeats`` independent Dirty prefills, each replayed from its valid
    prefix. Every decode is greedy (:func:`sur_lab.answer.answer`) and is scored by the gold NLL from the same cache.

    Args:
        lm: the model (its dtype and device are the condition's).
        edit: the cell's edit.
        answer_ids: canonical answer token ids (T >= 1).
        repeats: decodes per condition (>= 2; the paper: 3).
        max_new_tokens: decoding limit, tokens (>= 1).

    Returns:
        ``3 * repeats`` records with ``condition``, ``repeat``, ``token_ids``, ``text``, ``finished``, ``argmax``,
        ``logits_sha256`` (SHA-256 of the float32 first-logit bytes) and ``gold_nll`` (nats per answer token).

    Raises:
        ValueError: naming ``repeats`` (< 2), ``max_new_tokens`` (< 1) or ``answer_ids`` (empty).
    """
    if isinstance(repeats, bool) or int(repeats) != repeats or repeats < 2:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 2")
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if len(answer_ids) == 0:
        raise ValueError("answer_ids is empty")
    records = []
    shared = reprefill(lm, edit)
    for r in range(repeats):
        records.append({"condition": "shared", "repeat": r, **_decode_record(lm, shared, edit, answer_ids,
                                                                            max_new_tokens)})
    del shared
    for r in range(repeats):
        cache = reprefill(lm, edit)
        records.append({"condition": "reprefill", "repeat": r, **_decode_record(lm, cache, edit, answer_ids,
                                                                               max_new_tokens)})
    for r in range(repeats):
        cache = replay(lm, dirty(lm, edit), edit)
        records.append({"condition": "replay", "repeat": r, **_decode_record(lm, cache, edit, answer_ids,
                                                                            max_new_tokens)})
    return records


def run(lm: LoadedModel, cases: Sequence, *, repeats: int = REPEATS, max_new_tokens: int = 16,
        out: Path | str | None = None, progress: bool = False) -> pd.DataFrame:
    """:func:`run_cell` over evidence-location cases, one row per (case, condition, repeat).

    Args:
        lm: the model.
        cases: :class:`sur_lab.studies.evidence_location.LocationCase` objects (or anything with ``case_id``,
            ``edit``, ``answer_ids`` and a flat ``meta``), case ids unique.
        repeats, max_new_tokens: as :func:`run_cell`.
        out: a folder to store the rows in and resume from (:meth:`sur_lab.sweeps.SweepStore.run_keyed`: a cell is
            a case, its rows keyed by ``(condition, repeat)``, the table :data:`TABLE_FILE`; a cell stored with
            another model, dtype, device, ``repeats``, ``max_new_tokens``, versions or content is refused). ``None``:
            nothing is stored.
        progress: show a tqdm bar.

    Returns:
        Records with ``model`` (``lm.spec.name``), ``dtype``, ``device``, ``case_id``, the case meta (``dataset``,
        ``source_id``, ``cell``, ...) and :func:`run_cell`'s fields; input for :func:`cell_table`.

    Raises:
        ValueError: naming ``cases`` when empty or a case id repeats; as :func:`run_cell`; with ``out``, naming the
            folder, the cell and the first differing field when a stored cell was made with another fingerprint.
    """
    ids = [case.case_id for case in cases]
    if not ids or len(set(ids)) != len(ids):
        raise ValueError(f"cases must be non-empty with unique case ids; got {len(ids)} cases, "
                         f"{len(set(ids))} distinct ids")
    info = {"model": str(lm.spec.name), "dtype": str(lm.dtype).removeprefix("torch."), "device": device_name(lm.device)}

    def rows_of(case) -> list[dict[str, Any]]:
        meta = {k: case.meta[k] for k in ("dataset", "source_id", "cell") if k in case.meta}
        return [{**info, "case_id": case.case_id, **meta, **rec}
                for rec in run_cell(lm, case.edit, case.answer_ids, repeats=repeats, max_new_tokens=max_new_tokens)]

    if out is None:
        return pd.DataFrame([row for case in tqdm(cases, desc="execution paths", disable=not progress)
                             for row in rows_of(case)])
    fp = {**model_fingerprint(lm), "repeats": int(repeats), "max_new_tokens": int(max_new_tokens),
          "versions": versions()}
    return SweepStore(out).run_keyed(
        dict(zip(ids, cases)), rows_of, key=("condition", "repeat"), fingerprint=fp,
        case_fingerprint=lambda c: {"case": case_fingerprint(c.edit, answer_ids=list(c.answer_ids))},
        table=TABLE_FILE, progress=progress, desc="execution paths")
