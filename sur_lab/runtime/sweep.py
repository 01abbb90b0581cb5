"""Resumable sweeps of cases × methods × budgets with one Parquet record per (case, method, budget) (appendix 12).

Per case, :func:`run_sweep` prefills the original context once (Dirty), Shifts it once (:func:`sur_lab.repair.prepare`),
answers from Re-prefill and Dirty once, and shares these with every method and budget; each method then repairs the
shared Shift cache (or runs its reference operator), answers the query greedily and is scored against the gold answer,
against Re-prefill's answer and first-token distribution, and on Re-prefill's greedy continuation.

On-disk layout under ``out_dir`` (the part files are the source of truth, written as records finish):

- ``parts/<case>.jsonl``: one JSON record per line, appended and fsynced as soon as the record is complete, so an
  interrupted sweep loses at most the record in flight; a torn last line is ignored on reading.
- ``parts/<case>.ref.npz``: the case's shared reference signals (Re-prefill's and Dirty's first-token logits,
  Re-prefill's greedy continuation and parsed answer), written atomically before the case's first record; a resumed
  case reloads them instead of recomputing Re-prefill.
- ``records.parquet``: every requested record, consolidated (atomically) when the sweep finishes.
- ``sweep.json``: the configuration of the last call and its fingerprint.

Resuming: records already in ``parts/`` are neither recomputed nor rewritten. Every record carries the fingerprint
fields of what it depends on (:mod:`sur_lab.runtime.fingerprint`): the model's name, weights hash, dtype and device,
the seed, executor, decoding limit and rule, allocator options, the software versions and the case's content.
A stored record whose fields differ from the call's is never reused: a ``ValueError`` names ``out_dir`` and the first
differing field. :func:`sweep_folder` names a folder per model fingerprint, so that a run with another model, dtype or
device starts a new folder instead. A case's reference file (``.ref.npz``) stores the same fingerprint and is
recomputed when it does not match.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sur_lab.analysis.endpoints import nr_tv, reference_continuation
from sur_lab.analysis.evaluate import method_grid
from sur_lab.analysis.scoring import (
    agreement,
    exact_match,
    extract_answer,
    first_token_tv,
)
from sur_lab.answer import Answer, answer, continuation_nll
from sur_lab.edits import EditedContext
from sur_lab.executors import get_executor
from sur_lab.models import LoadedModel
from sur_lab.repair import RepairResult, prepare, repair
from sur_lab.runtime.paths import atomic_path
from sur_lab.runtime.fingerprint import digest, first_difference, model_fingerprint, versions

#: The four reference operators.
REFERENCES = ("Dirty", "Shift", "Replay", "Re-prefill")
#: Record fields that are wall-clock timings (differ between otherwise identical runs).
TIMING_FIELDS = (
    "dirty_ms", "select_ms", "shift_ms", "refresh_ms", "query_ms", "decode_ms", "answer_ms", "latency_ms",
)
#: Record fields that must match for a stored record to be reused (the call's configuration, then the case's content).
_CONFIG_FIELDS = (
    "model", "model_weights", "dtype", "device", "seed", "executor", "max_new_tokens", "decoding", "options",
    "versions", "case_fingerprint",
)
#: Decoding rule of every answer in a sweep (recorded so that a future sampling option cannot reuse greedy records).
DECODING = "greedy"
_SCALARS = (str, int, float, bool, type(None), np.integer, np.floating, np.bool_)


@dataclass(frozen=True)
class SweepCase:
    """One case of any task.

    Attributes:
        case_id: unique, stable identifier (part-file names derive from it).
        edit: the edit.
        gold: gold answers (for QA: the answer and its aliases; for NIAH: the ordered value list).
        meta: flat scalars copied into every record (dataset, placement, source_id, context_len, depth, ...).
    """

    case_id: str
    edit: EditedContext
    gold: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)


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


def sweep_config(lm: LoadedModel, *, seed: int = 0, executor: str = "sequential", max_new_tokens: int = 64,
                 options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The fingerprint fields every record of :func:`run_sweep` carries (flat JSON scalars).

    ``model``, ``model_weights`` (weights hash), ``dtype``, ``device`` (:func:`sur_lab.runtime.fingerprint.
    model_fingerprint`), ``seed``, ``executor``, ``max_new_tokens``, ``decoding``, ``options`` (hash of the allocator
    options, models by their fingerprint) and ``versions``. The scorer and parser are not part of it: they are
    applied to the stored answer text, and a resumed sweep may wrap them (e.g. to count calls).
    """
    return {
        **model_fingerprint(lm), "seed": int(seed), "executor": executor, "max_new_tokens": int(max_new_tokens),
        "decoding": DECODING, "options": digest(dict(options or {})), "versions": versions(),
    }


def sweep_folder(name: str, lm: LoadedModel, *, outputs: Path | None = None, **params: Any) -> Path:
    """A sweep folder named by the study, the parameters and the model's fingerprint, so that a run with another
    model, weights, dtype or device never resumes (or republishes) another's records.

    ``<outputs>/sweeps/<name>_<run_tag(params)>_<dtype>_<device>_w<weights hash, 8>``.

    Args:
        name: study prefix, e.g. ``"02_niah"``.
        lm: the model.
        outputs: outputs root (default :func:`sur_lab.runtime.paths.outputs_dir`).
        params: parameter values for the name (:func:`sur_lab.analysis.plotting.run_tag`).
    """
    from sur_lab.analysis.plotting import run_tag
    from sur_lab.runtime.paths import outputs_dir

    fp = model_fingerprint(lm)
    device = fp["device"].split(" ")[0].replace(":", "")
    tag = run_tag(**{**params, "dtype": fp["dtype"], "device": device, "w": fp["model_weights"][:8]})
    return (outputs or outputs_dir()) / "sweeps" / f"{name}_{tag}"


def _slug(case_id: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", case_id)[:80]
    return f"{safe}-{hashlib.sha1(case_id.encode()).hexdigest()[:8]}"


def _budget_key(budget: float) -> str:
    return "ref" if budget is None or (isinstance(budget, float) and math.isnan(budget)) else repr(float(budget))


def _read_part(path: Path) -> dict[tuple[str, str], dict]:
    """Records of one part file by (method, budget key); a torn (partially written) line is skipped."""
    out: dict[tuple[str, str], dict] = {}
    if not path.exists():
        return out
    with path.open("r", encoding="utf-8") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[(rec["method"], _budget_key(rec["budget_pct"]))] = rec
    return out


def _drop_torn_tail(path: Path) -> None:
    """Truncate a part file after its last complete line (a record torn by a crash mid-write), so appends stay
    line-aligned."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)


@contextlib.contextmanager
def _sweep_lock(out_dir: Path):
    """Hold ``out_dir/.sweep.lock`` for the whole call: two processes appending to the same part files would interleave
    records and race on ``records.parquet``, so a second concurrent sweep of one folder fails at once."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(out_dir / ".sweep.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise RuntimeError(
            f"out_dir={str(out_dir)!r} is in use by another sweep (lock {lock.lock_file}); wait for it or use another "
            "folder"
        ) from None
    try:
        yield
    finally:
        lock.release()


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place (readers never see a torn file)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _append_record(path: Path, record: dict) -> None:
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, allow_nan=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _plain(value: Any) -> Any:
    """Python scalars for JSON (numpy scalars unwrapped)."""
    return value.item() if isinstance(value, np.generic) else value


def _as_text(parsed: Any) -> str:
    if isinstance(parsed, str):
        return parsed
    return json.dumps(list(parsed) if isinstance(parsed, (list, tuple)) else parsed)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(a) == tuple(b)
    return a == b


@dataclass
class _Reference:
    """The case's shared reference signals (in memory; persisted in ``<case>.ref.npz``)."""

    logits: np.ndarray  # Re-prefill first-token logits, float32 [V]
    dirty_logits: np.ndarray  # Dirty first-token logits, float32 [V]
    continuation: list[int]  # Re-prefill's greedy ids (EOS excluded)
    text: str  # Re-prefill's answer text
    fingerprint: str = ""  # digest of the sweep config and case fingerprint it was computed with
    computed: dict[str, tuple[RepairResult, Answer]] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(
            tmp, logits=self.logits, dirty_logits=self.dirty_logits,
            continuation=np.asarray(self.continuation, dtype=np.int64), text=np.asarray(self.text),
            fingerprint=np.asarray(self.fingerprint),
        )
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "_Reference | None":
        """The stored reference, or ``None`` when the file is unreadable (torn by a crash)."""
        try:
            with np.load(path) as z:
                fp = str(z["fingerprint"]) if "fingerprint" in z.files else ""
                return cls(z["logits"], z["dirty_logits"], z["continuation"].tolist(), str(z["text"]), fp)
        except (OSError, ValueError, KeyError, EOFError):
            return None


def _check_meta(case: SweepCase) -> None:
    for key, value in case.meta.items():
        if not isinstance(value, _SCALARS):
            raise ValueError(f"case {case.case_id!r}: meta[{key!r}] must be a flat scalar; got {type(value).__name__}")
        if key in _RECORD_FIELDS:
            raise ValueError(f"case {case.case_id!r}: meta key {key!r} collides with a record field")


_RECORD_FIELDS = frozenset(
    """case_id model model_weights dtype device seed case_seed executor max_new_tokens decoding options versions
    case_fingerprint method budget_pct allowance prefix_len
    deleted_len suffix_len num_intervals positions intervals extra_forward_tokens extra_forward_layers tied_units answer
    prediction gold em agree_reprefill tv_reprefill tv_dirty_reprefill nr_tv nll_reprefill nll_tokens
    finished workers threads""".split()
    + list(TIMING_FIELDS)
)


def _concurrency() -> dict:
    """The record fields saying how the record was measured: one worker, this process's torch threads."""
    import torch

    return {"workers": 1, "threads": torch.get_num_threads()}


def check_sweep_args(cases, methods, budgets, executor: str, max_new_tokens: int) -> list:
    """Check a sweep's arguments before any work; return the (method, budget) grid.

    Shared by the serial (``run_sweep``) and the Ray (``run_sweep_distributed``) drivers.

    Raises:
        ValueError: naming ``methods``/``budgets`` (unknown method, budget outside (0, 100] %), ``executor`` (unknown),
            ``max_new_tokens`` (not an integer >= 1), or ``cases`` (duplicate ``case_id``, missing metadata).
    """
    grid = method_grid(methods, budgets)
    get_executor(executor)
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
    ids = [c.case_id for c in cases]
    if len(set(ids)) != len(ids):
        raise ValueError("cases must have unique case_id values")
    for case in cases:
        _check_meta(case)
    return grid


def run_sweep(
    lm: LoadedModel,
    cases: Sequence[SweepCase],
    methods: Sequence[str],
    budgets: Sequence[float],
    out_dir: Path,
    *,
    max_new_tokens: int = 64,
    executor: str = "sequential",
    scorer: Callable[[SweepCase, str], bool] | None = None,
    parser: Callable[[str], Any] | None = None,
    seed: int = 0,
    progress: bool = True,
    options: Mapping[str, Any] | None = None,
    workers: int = 1,
    address: str | None = None,
    threads: int | None = None,
) -> pd.DataFrame:
    """Run every (case, method, budget), persisting each record as it finishes; resume what a previous call left.

    Args:
        lm: the model.
        cases: the cases (unique ``case_id``).
        methods: reference operators (``"Dirty"``, ``"Shift"``, ``"Replay"``, ``"Re-prefill"``; one record each, budget
            NaN) and allocator names (one record per budget).
        budgets: budgets b in [0, 100], %.
        out_dir: directory for part files and ``records.parquet`` (created).
        max_new_tokens: greedy decoding limit, tokens (EOS-aware).
        executor: sparse-refresh executor name.
        scorer: ``fn(case, answer_text) -> bool`` giving ``em``; default: when ``case.gold`` is non-empty, the parsed
            answer equals the gold sequence (``parser`` given and returning a list/tuple) or normalized exact match
            over the gold aliases (:func:`sur_lab.analysis.scoring.exact_match`); else ``em`` is None.
        parser: ``fn(answer_text) -> parsed`` for ``prediction`` and Re-prefill agreement (same parsed answer);
            default :func:`sur_lab.analysis.scoring.extract_answer` with normalized agreement
            (:func:`sur_lab.analysis.scoring.agreement`).
        seed: sweep seed; each case's allocators get :func:`case_seed` ``(seed, case_id)``.
        progress: show a tqdm bar over all records.
        options: allocator options passed to every allocator (e.g. ``{"aux_model": lm_aux}`` for SpecCache-Adapted);
            the case's Dirty cache is always added as ``"dirty_cache"``.
        workers, address, threads: ``workers > 1`` or an ``address`` runs the cases on Ray actors
            (:func:`sur_lab.runtime.distributed.run_sweep_distributed`, same records and files; ``lm`` may then be a
            mapping of :func:`sur_lab.models.load_model` arguments). ``workers=1`` without an address runs here.

    Returns:
        DataFrame of the requested records (cases in order, then the method grid in order), also written to
        ``out_dir/records.parquet``. Fields: case meta; ``case_id``; the fingerprint fields of :func:`sweep_config`
        (``model``, ``model_weights``, ``dtype``, ``device``, ``seed``, ``executor``, ``max_new_tokens``,
        ``decoding``, ``options``, ``versions``); ``case_seed``, ``case_fingerprint``; ``method``, ``budget_pct`` (NaN for references), ``allowance`` (B),
        ``prefix_len``, ``deleted_len``, ``suffix_len`` (S); ``num_intervals`` (R), ``positions`` (suffix-local),
        ``intervals`` (half-open, suffix-local); ``extra_forward_tokens``, ``extra_forward_layers`` (selection
        signal cost); ``tied_units`` (SUR's units tied after rounding, appendix 7.3; None for other methods); timings in ms: ``dirty_ms`` (excluded from latency), ``select_ms``, ``shift_ms``,
        ``refresh_ms``, ``query_ms``, ``decode_ms``, ``answer_ms``, ``latency_ms`` (= select + shift + refresh +
        answer, Eq. 20); outputs: ``answer`` (text), ``prediction`` (parsed, JSON for non-strings), ``gold``,
        ``finished`` (EOS reached); scores: ``em`` (bool or None), ``agree_reprefill``, ``tv_reprefill``,
        ``tv_dirty_reprefill``, ``nr_tv`` (Eq. 14), ``nll_reprefill`` (summed NLL in nats of Re-prefill's greedy
        continuation; NaN when it is empty) and ``nll_tokens``; concurrency: ``workers`` (processes sharing the
        machine) and ``threads`` (torch intra-op threads).

    Raises:
        ValueError: for an unknown method or executor, a budget outside [0, 100], ``max_new_tokens`` < 1, duplicate
            case ids, non-scalar or colliding meta (all before any model call), or naming ``out_dir`` and the
            first differing field when it holds records made with another configuration (model name, weights,
            dtype, device, seed, executor, decoding, allocator options, versions or case content).
        RuntimeError: naming ``out_dir`` when another process is running a sweep into it (nothing is written).
    """
    from tqdm.auto import tqdm

    if type(workers) is not int or workers != 1 or address is not None:
        from sur_lab.runtime.distributed import run_sweep_distributed

        return run_sweep_distributed(
            lm, cases, methods, budgets, out_dir, workers=workers, address=address, threads=threads,
            max_new_tokens=max_new_tokens, executor=executor, scorer=scorer, parser=parser, seed=seed,
            progress=progress, options=options,
        )
    grid = check_sweep_args(cases, methods, budgets, executor, max_new_tokens)
    ids = [c.case_id for c in cases]
    out_dir = Path(out_dir)
    parts = out_dir / "parts"
    config = sweep_config(lm, seed=seed, executor=executor, max_new_tokens=max_new_tokens, options=options)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _sweep_lock(out_dir):
        stored = {c.case_id: _read_part(parts / f"{_slug(c.case_id)}.jsonl") for c in cases}
        fingerprints = {c.case_id: case_fingerprint(c.edit, c.gold, {k: _plain(v) for k, v in c.meta.items()})
                        for c in cases}
        for case in cases:
            expected = {**config, "case_fingerprint": fingerprints[case.case_id]}
            for rec in stored[case.case_id].values():
                bad = first_difference(rec, expected)
                if bad is not None:
                    raise ValueError(
                        f"out_dir={str(out_dir)!r} holds a record of case {case.case_id!r} made with another {bad} "
                        f"({rec.get(bad)!r} vs {expected[bad]!r} now); use a fresh out_dir (sweep_folder names one per "
                        "model, dtype and device)"
                    )
        parts.mkdir(parents=True, exist_ok=True)
        _write_atomic(out_dir / "sweep.json", json.dumps(
            {**config, "fingerprint": digest(config), "methods": list(methods), "budgets": [float(b) for b in budgets],
             "cases": ids}, indent=1,
        ))
        keys = [(m, _budget_key(b)) for m, b in grid]
        done = sum(sum(k in stored[c.case_id] for k in keys) for c in cases)
        bar = tqdm(total=len(cases) * len(grid), initial=done, disable=not progress, desc="sweep", unit="record")
        try:
            for case in cases:
                todo = [(m, b) for (m, b), k in zip(grid, keys) if k not in stored[case.case_id]]
                if not todo:
                    continue
                bar.set_postfix_str(case.case_id)
                _run_case(lm, case, todo, parts, {**config, **_concurrency()}, fingerprints[case.case_id], bar,
                          scorer=scorer, parser=parser, options=options)
        finally:
            bar.close()

        rows = []
        for case in cases:
            recs = _read_part(parts / f"{_slug(case.case_id)}.jsonl")
            rows.extend(recs[k] for k in keys if k in recs)
        df = pd.DataFrame(rows)
        with atomic_path(out_dir / "records.parquet") as tmp:
            df.to_parquet(tmp, index=False)
        return df


def _run_case(
    lm: LoadedModel,
    case: SweepCase,
    todo: list[tuple[str, float]],
    parts: Path,
    config: dict,
    fingerprint: str,
    bar,
    *,
    scorer,
    parser,
    options,
) -> None:
    edit = case.edit
    part = parts / f"{_slug(case.case_id)}.jsonl"
    ref_path = parts / f"{_slug(case.case_id)}.ref.npz"
    _drop_torn_tail(part)
    prepared = prepare(lm, edit)
    max_new = config["max_new_tokens"]
    # The shared references depend on the configuration, not on how many workers or threads measured them.
    ref_fp = digest({**{k: v for k, v in config.items() if k not in ("workers", "threads")},
                     "case_fingerprint": fingerprint})
    ref = _Reference.load(ref_path) if ref_path.exists() else None
    if ref is None or ref.fingerprint != ref_fp:  # absent, torn, or computed for another configuration: recompute
        result = repair(lm, prepared, "Re-prefill")
        ans = answer(lm, result.cache, edit, max_new_tokens=max_new)
        wants_dirty = any(m == "Dirty" for m, _ in todo)
        dirty_result = repair(lm, prepared, "Dirty")
        dirty_ans = answer(lm, dirty_result.cache, edit, max_new_tokens=max_new if wants_dirty else 1)
        ref = _Reference(
            ans.first_token_logits.numpy().astype(np.float32), dirty_ans.first_token_logits.numpy().astype(np.float32),
            reference_continuation(ans.token_ids), ans.text, ref_fp,
        )
        ref.computed["Re-prefill"] = (result, ans)
        if wants_dirty:
            ref.computed["Dirty"] = (dirty_result, dirty_ans)
        ref.save(ref_path)
    tv_dirty = first_token_tv(ref.dirty_logits, ref.logits)
    ref_parsed = parser(ref.text) if parser is not None else extract_answer(ref.text)
    seed_c = case_seed(config["seed"], case.case_id)
    opts = {**dict(options or {}), "dirty_cache": prepared.dirty_cache}
    base = {
        **{k: _plain(v) for k, v in case.meta.items()},
        "case_id": case.case_id, **config, "case_seed": seed_c, "case_fingerprint": fingerprint,
    }
    for method, budget in todo:
        bar.set_postfix_str(f"{case.case_id} {method} {'' if math.isnan(budget) else budget}")
        if method in ref.computed:
            result, ans = ref.computed.pop(method)
        else:
            result = repair(lm, prepared, method, budget, executor=config["executor"], seed=seed_c, options=opts)
            ans = answer(lm, result.cache, edit, max_new_tokens=max_new)
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
        tv = first_token_tv(ans.first_token_logits, ref.logits)
        nll = continuation_nll(lm, result.cache, edit, ref.continuation) if ref.continuation else float("nan")
        support = result.support
        sel = result.selection
        t = result.timings_ms
        record = {
            **base,
            "method": method,
            "budget_pct": float(budget),
            "allowance": int(result.allowance),
            "prefix_len": edit.prefix_len,
            "deleted_len": edit.deleted_len,
            "suffix_len": edit.suffix_len,
            "num_intervals": support.num_intervals if support is not None else (1 if result.allowance else 0),
            "positions": support.positions.tolist() if support is not None else [],
            "intervals": [list(iv) for iv in support.intervals] if support is not None else [],
            "extra_forward_tokens": int(sel.extra_forward_tokens) if sel is not None else 0,
            "extra_forward_layers": int(sel.diagnostics.get("extra_forward_layers", 0)) if sel is not None else 0,
            # SUR / SUR-IDF: units tied after rounding (appendix 7.3 tie rule); None for allocators without unit ranks.
            "tied_units": sel.diagnostics.get("tied_units") if sel is not None else None,
            "dirty_ms": prepared.dirty_ms,
            "select_ms": t["select"],
            "shift_ms": t["shift"],
            "refresh_ms": t["refresh"],
            "query_ms": ans.timings_ms["query"],
            "decode_ms": ans.timings_ms["decode"],
            "answer_ms": ans.timings_ms["answer"],
            "latency_ms": t["select"] + t["shift"] + t["refresh"] + ans.timings_ms["answer"],
            "answer": ans.text,
            "prediction": _as_text(parsed),
            "gold": list(case.gold),
            "finished": bool(ans.finished),
            "em": em,
            "agree_reprefill": bool(agree),
            "tv_reprefill": tv,
            "tv_dirty_reprefill": tv_dirty,
            "nr_tv": nr_tv(min(tv, 1.0), min(tv_dirty, 1.0)),
            "nll_reprefill": nll,
            "nll_tokens": len(ref.continuation),
        }
        _append_record(part, record)
        bar.update(1)
