"""The one schema of a sweep record: :class:`Record`, one row per (case, method, budget, protocol) (appendix 12).

A record says what was repaired (the case, the method and its budget), with what (the fingerprint fields: model,
weights, dtype, device, seed, executor, decoding, evaluation batch, options, versions, case content), how it was
measured (workers, threads, whether its answer timings are per request), the support and its cost, the Eq. 20
timings, the answer and the endpoints. The case's study-specific columns (dataset, placement, context length...) ride
along in :attr:`Record.meta` and become ordinary columns in every table.

Serialisations: :meth:`Record.to_json` / :meth:`Record.from_json` (one JSON object per line of a part file; meta keys
flattened beside the fields), :meth:`Record.to_row` / :meth:`Record.from_row` (one Parquet or DataFrame row, the same
flat mapping), :func:`records_frame` (a DataFrame of records with a stable column order). :func:`parse_line` validates
a stored line against the schema (every field present with its type and within its range, :data:`FIELD_RANGES`; meta
flat scalars; with ``meta_keys``, no key beyond the case's) and raises ``ValueError`` saying what is wrong, so that
the store can report and recompute an invalid line instead of crashing or reusing it.

To add a field: declare it below with its unit in the docstring and its annotation (:data:`FIELD_TYPES` is read
from it), when it has one a range in :data:`FIELD_RANGES` (both checked where a record is built and by
:func:`parse_line`), and fill it where records are built (:func:`sur_lab.sweeps.case.run_case`). Stored records
without it then fail validation and are recomputed, with a warning naming the file, line and field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

import numpy as np
import pandas as pd

from sur_lab.fingerprint import digest, model_fingerprint, versions

#: Decoding rule of every answer in a sweep (recorded so that a future sampling option cannot reuse greedy records).
DECODING = "greedy"
#: Record fields that are wall-clock timings in ms (they differ between otherwise identical runs).
TIMING_FIELDS = (
    "dirty_ms", "select_ms", "shift_ms", "refresh_ms", "query_ms", "decode_ms", "answer_ms", "latency_ms",
)
#: Answer timings: per request only when :attr:`Record.timed` (NaN otherwise; Eq. 20's answer term).
ANSWER_TIMING_FIELDS = ("query_ms", "decode_ms", "answer_ms", "latency_ms")
#: Fields saying how a record was measured (they may differ between otherwise identical runs): ``dtype_reason``
#: says why the model ran in its dtype (``"auto"`` and an explicit ``"bfloat16"`` make the same records).
CONDITION_FIELDS = ("workers", "threads", "dtype_reason")
#: Fingerprint fields that depend on the call's configuration (model and settings), in the order a mismatch is named.
CONFIG_FIELDS = (
    "model", "model_weights", "dtype", "device", "seed", "executor", "max_new_tokens", "decoding", "eval_batch",
    "options", "versions",
)
#: The configuration fields that name the model (:func:`sur_lab.fingerprint.model_fingerprint`): the only ones in which
#: the per-model runs a cross-model assembly pools (``niah.combine``, ``evidence_location.combine``) may differ.
MODEL_FIELDS = ("model", "model_weights", "dtype", "device")
#: Every fingerprint field: the configuration, then the case's content.
FINGERPRINT_FIELDS = (*CONFIG_FIELDS, "case_fingerprint")
#: Methods that are not budgeted carry this budget (NaN), so a table can tell them apart.
NO_BUDGET = float("nan")


@dataclass(frozen=True, kw_only=True)
class Record:
    """One sweep record: a method at a budget on one case, with its fingerprint, support, timings, answer and scores.

    Identity:
        case_id: the case's stable identifier.
        method: a reference operator (``"Dirty"``, ``"Shift"``, ``"Replay"``, ``"Re-prefill"``), an allocator name
            (``"SUR"``), or a study's method label (:class:`sur_lab.sweeps.case.Method`).
        budget_pct: b, % of the suffix (Eq. 3); NaN for methods without a budget (the references).
        protocol: how the support's rows were obtained: ``"forward"`` (computed by the model: an executor or a
            reference operator) or ``"donor"`` (copied from the reference cache: a diagnostic upper bound).

    Fingerprint (what the record depends on; a stored record is reused only when all of them match):
        model, model_weights, dtype, device: :func:`sur_lab.fingerprint.model_fingerprint` (name, weights hash,
            parameter dtype, device with its kind).
        seed: the sweep seed; case_seed: the seed the case's randomized allocators got
            (:func:`sur_lab.sweeps.case.case_seed`).
        executor: the sparse-refresh executor's registered name.
        max_new_tokens: greedy decoding limit, tokens. decoding: the decoding rule (``"greedy"``).
        eval_batch: records answered together at most (1: one at a time, the per-record path).
        options: digest of the allocator options. versions: sur_lab, torch and transformers versions.
        case_fingerprint: hash of the case's content (tokens, span, query, text offsets, gold, meta).

    Measurement conditions:
        workers: processes sharing the machine (Ray actors; 1 for a local run).
        threads: torch intra-op threads of the process that made the record.
        dtype_reason: why the model ran in ``dtype`` (:attr:`sur_lab.models.LoadedModel.dtype_reason`:
            ``"requested"``, or the choice of ``dtype="auto"`` and its reason).
        timed: True when the answer timings (``query_ms``, ``decode_ms``, ``answer_ms``, ``latency_ms``) were measured
            on this record alone, unbatched (per request); False when the answer came from a batched pass and those
            timings are NaN (timing honesty: a batched pass never yields latency).
        shared_prefix: True when the case's references were built on one prefill of their common prefix (exact prefix
            sharing, :attr:`sur_lab.repair.PreparedEdit.share_prefix`): Replay's suffix forward ran once on the
            Dirty prefill's valid prefix and served Replay, every allocator at B = S and Re-prefill (whose cache is
            then that Replay, equal to a rebuild from empty in exact arithmetic, and whose ``refresh_ms`` is NaN: no
            rebuild ran). False for an independent Re-prefill, and always for a timed case (its latencies are per
            request). Part of the fingerprint.

    Geometry and cost:
        prefix_len (p), deleted_len (d), suffix_len (S): tokens of the edit.
        cache_len: rows of the pre-query cache that was answered (p + S after a repair; N = p + d + S for Dirty;
            another length for operators that append, e.g. a correction note).
        allowance: B, suffix positions recomputed (S for Replay and Re-prefill, 0 for Shift and Dirty).
        num_intervals: R, maximal intervals of the support (Replay and Re-prefill: 1 when S > 0).
        positions: the support, suffix-local positions (empty for references).
        intervals: the support's maximal intervals, half-open ``(start, end)``, suffix-local.
        extra_forward_tokens, extra_forward_layers: token-forwards (and the deepest layer count) spent on the
            allocator's selection signals.
        tied_units: SUR's units tied at the rounding boundary (appendix 7.3); None for allocators without unit ranks.
        note_tokens: L, tokens of a correction note appended after the context (Erratum; 0 for every other method).
        note_template: the note's template name (:data:`sur_lab.executors.ERRATUM_TEMPLATES`; ``""`` without note).

    Timings, ms (wall clock):
        dirty_ms: the original prefill (not part of post-edit latency).
        select_ms, shift_ms, refresh_ms: Eq. 20's selection, position correction and refresh (Re-prefill's rebuild is
            its refresh); measured on this record's repair, one repair at a time.
        query_ms, decode_ms, answer_ms: query forward, greedy decoding and their sum (NaN unless ``timed``).
        latency_ms: post-edit latency, Eq. 20: select + shift + refresh + answer (NaN unless ``timed``).

    Answer:
        answer: the decoded text (special tokens skipped). prediction: the parsed answer (JSON for a list).
        gold: gold answers of the case. finished: True when EOS ended decoding.

    Endpoints:
        em: exact match against ``gold`` by the study's scorer (None when the case has no gold).
        agree_reprefill: the parsed answer equals Re-prefill's (the study's parser and agreement rule).
        sequence_agree: the generated token ids equal Re-prefill's exactly.
        tv_reprefill: total variation between this method's and Re-prefill's first-token distributions, [0, 1].
        tv_dirty_reprefill: the same for Dirty (the case's normaliser of Eq. 14).
        nr_tv: normalised first-token recovery, Eq. 14 (NaN when undefined).
        nll_reprefill: summed teacher-forced negative log-likelihood of Re-prefill's greedy continuation after the
            query, nats (NaN when the continuation is empty). nll_tokens: its length, tokens.
        jsd_reprefill: Jensen-Shannon divergence between this method's and Re-prefill's first-token distributions,
            nats, in [0, ln 2] (:func:`sur_lab.analysis.endpoints.first_token_jsd`; Table 16).
        argmax_agree: the first-token argmax (the greedy first token) equals Re-prefill's
            (:func:`sur_lab.analysis.endpoints.argmax_agree`).
        logits_identical: the float32 first-token logit vector is byte-identical to Re-prefill's (appendix 11;
            :func:`sur_lab.analysis.endpoints.logits_identical`). Bitwise: it depends on the batch the answer was
            computed in, so compare it only between records of equal ``eval_batch`` and ``threads``.
        logits_digest: SHA-256 (hex) of this answer's own float32 first-token logits
            (:func:`sur_lab.analysis.endpoints.logits_digest`): equal digests are identical logits (Table 17).
        gold_nll: mean teacher-forced negative log-probability of the case's canonical gold answer after the query,
            nats per answer token (appendix 10.2's primary endpoint; :func:`sur_lab.analysis.endpoints.gold_nll`);
            NaN when the case has no answer target (:attr:`sur_lab.sweeps.Case.answer_ids`).
            gold_tokens: T, tokens of that answer target (0 when there is none).
        gold_margin: the gold answer's first-token margin ``z[g] - max_{v != g} z[v]`` at the first answer step,
            logit units (:func:`sur_lab.analysis.endpoints.gold_margin`; issue 26). ``g`` is ``meta["gold_token"]``
            when the case declares it (a study whose query ends with an answer prefix, so that the first answer step
            predicts it), else the first token of the case's answer target; NaN without either. Its recovery between
            Shift and Re-prefill is computed over a case's records
            (:func:`sur_lab.analysis.endpoints.add_margin_recovery`).
        old_margin: the superseded value's pull at the first answer step, ``z[o] - z[g]``: the logit of the old
            value's first token minus the gold answer's first token, logit units
            (:func:`sur_lab.analysis.endpoints.old_margin`; issue 40). ``o`` is ``meta["old_token"]`` and ``g`` the
            token of ``gold_margin``; NaN when the case declares no old token (a study without a superseded value).
            Unbounded in both directions (no :data:`FIELD_RANGES` entry): positive means the old value's first token
            leads the gold one.

    Case columns:
        meta: the case's flat scalar columns (dataset, placement, context length...), flattened beside the fields.
    """

    case_id: str
    method: str
    budget_pct: float
    protocol: str = "forward"
    model: str
    model_weights: str
    dtype: str
    device: str
    seed: int
    case_seed: int
    executor: str
    max_new_tokens: int
    decoding: str = DECODING
    eval_batch: int
    options: str
    versions: str
    case_fingerprint: str
    workers: int = 1
    threads: int
    dtype_reason: str = "requested"
    timed: bool
    shared_prefix: bool = False
    prefix_len: int
    deleted_len: int
    suffix_len: int
    cache_len: int
    allowance: int
    num_intervals: int
    positions: tuple[int, ...] = ()
    intervals: tuple[tuple[int, int], ...] = ()
    extra_forward_tokens: int = 0
    extra_forward_layers: int = 0
    tied_units: int | None = None
    note_tokens: int = 0
    note_template: str = ""
    dirty_ms: float
    select_ms: float
    shift_ms: float
    refresh_ms: float
    query_ms: float
    decode_ms: float
    answer_ms: float
    latency_ms: float
    answer: str
    prediction: str
    gold: tuple[str, ...] = ()
    finished: bool
    em: bool | None = None
    agree_reprefill: bool
    sequence_agree: bool
    tv_reprefill: float
    tv_dirty_reprefill: float
    nr_tv: float
    nll_reprefill: float
    nll_tokens: int
    jsd_reprefill: float
    argmax_agree: bool
    logits_identical: bool
    logits_digest: str
    gold_nll: float
    gold_tokens: int
    gold_margin: float
    old_margin: float
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Every field is stored in its schema type (numpy scalars unwrapped, lists as tuples), so a record always
        # serialises and a wrong type is refused where the record is built.
        for name in FIELD_NAMES:
            object.__setattr__(self, name, _coerce(name, getattr(self, name)))
        object.__setattr__(self, "meta", {k: _plain(v) for k, v in dict(self.meta).items()})
        check_meta(self.meta, self.case_id)

    @property
    def key(self) -> tuple[str, str, str]:
        """``(method, budget key, protocol)``: what identifies a record within its case (:func:`record_key`)."""
        return record_key(self.method, self.budget_pct, self.protocol)

    def to_json(self) -> dict[str, Any]:
        """The record as one flat JSON-ready mapping: meta keys first, then every field (lists for sequences)."""
        out: dict[str, Any] = {k: _plain(v) for k, v in self.meta.items()}
        for f in FIELD_NAMES:
            value = getattr(self, f)
            if f == "intervals":
                value = [list(iv) for iv in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f] = value
        return out

    def to_line(self) -> str:
        """One JSON line (no trailing newline); NaN is written as ``NaN`` (read back by :func:`parse_line`)."""
        return json.dumps(self.to_json(), allow_nan=True)

    def to_row(self) -> dict[str, Any]:
        """The record as one DataFrame / Parquet row (the same flat mapping as :meth:`to_json`)."""
        return self.to_json()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Record":
        """A record from a flat mapping (:meth:`to_json`'s form): fields by name, every other key into ``meta``.

        Raises:
            ValueError: naming the first missing field, a field of the wrong type, or a meta value that is not a flat
                scalar.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a record must be a JSON object; got {type(data).__name__}")
        missing = [name for name in FIELD_NAMES if name not in data]
        if missing:
            raise ValueError(f"field {missing[0]!r} is missing")
        meta = {k: v for k, v in data.items() if k not in FIELD_SET}
        return cls(**{name: data[name] for name in FIELD_NAMES}, meta=meta)

    from_row = from_json


#: Field names in declaration order (meta excluded).
FIELD_NAMES = tuple(f.name for f in fields(Record) if f.name != "meta")
FIELD_SET = frozenset(FIELD_NAMES) | {"meta"}
_STR, _INT, _FLOAT, _BOOL = "str", "int", "float", "bool"
#: The stored type of each annotation :class:`Record` uses (an annotation not listed here is a schema error).
_KINDS: dict[Any, str] = {
    str: _STR, int: _INT, float: _FLOAT, bool: _BOOL, int | None: "int?", bool | None: "bool?",
    tuple[int, ...]: "ints", tuple[str, ...]: "strs", tuple[tuple[int, int], ...]: "intervals",
}


def _field_types(cls: type) -> dict[str, str]:
    """Each field's stored type (meta excluded), in declaration order, read from dataclass ``cls``'s annotations
    through :data:`_KINDS`.

    Raises:
        TypeError: naming a field whose annotation has no stored type.
    """
    hints = get_type_hints(cls)
    names = [f.name for f in fields(cls) if f.name != "meta"]
    unknown = [f"{name}: {hints[name]}" for name in names if hints[name] not in _KINDS]
    if unknown:
        raise TypeError(f"{cls.__name__} fields with no stored type (add it to _KINDS): {unknown}")
    return {name: _KINDS[hints[name]] for name in names}


#: Each field's stored type: str, int, float (NaN allowed), bool, an optional form ("int?" / "bool?"), or a list form
#: ("ints", "strs", "intervals"), derived from :class:`Record`'s annotations (the schema is declared once).
FIELD_TYPES: dict[str, str] = _field_types(Record)
#: Slack of the float ranges: values a few float64 ulps outside a bound are rounding (a TV summed over a vocabulary),
#: not a wrong unit.
RANGE_SLACK = 1e-9
_COUNTS = ("prefix_len", "deleted_len", "suffix_len", "cache_len", "allowance", "num_intervals", "extra_forward_tokens",
           "extra_forward_layers", "tied_units", "note_tokens", "nll_tokens", "gold_tokens", "seed", "case_seed")
#: Each numeric field's allowed closed range ``(low, high)`` (None: unbounded), from its definition in
#: :class:`Record`: TV in [0, 1], JSD in [0, ln 2] nats, budgets in [0, 100] %, NLLs and timings (ms) nonnegative,
#: counts nonnegative, workers, threads, eval_batch and max_new_tokens at least 1. NaN passes (a float field NaN
#: means "not defined for this record"); booleans (``em`` included) are checked by type.
FIELD_RANGES: dict[str, tuple[float | None, float | None]] = {
    "budget_pct": (0.0, 100.0), "tv_reprefill": (0.0, 1.0), "tv_dirty_reprefill": (0.0, 1.0),
    "jsd_reprefill": (0.0, math.log(2.0)), "nll_reprefill": (0.0, None), "gold_nll": (0.0, None),
    **{t: (0.0, None) for t in TIMING_FIELDS}, **{c: (0, None) for c in _COUNTS},
    "workers": (1, None), "threads": (1, None), "eval_batch": (1, None), "max_new_tokens": (1, None),
}
assert set(FIELD_RANGES) <= set(FIELD_NAMES), set(FIELD_RANGES) - set(FIELD_NAMES)
_SCALARS = (str, int, float, bool, type(None), np.integer, np.floating, np.bool_)


def record_key(method: str, budget_pct: float | None, protocol: str = "forward") -> tuple[str, str, str]:
    """What identifies a record within its case: ``(method, budget key, protocol)``; the budget key is ``"ref"`` for
    an unbudgeted method (NaN or None) and ``repr(float(b))`` otherwise, so 5 and 5.0 are one key."""
    nan = budget_pct is None or (isinstance(budget_pct, float) and math.isnan(budget_pct))
    return (method, "ref" if nan else repr(float(budget_pct)), protocol)


def check_meta(meta: Mapping[str, Any], case_id: str = "") -> None:
    """Refuse meta values that are not flat scalars, and keys that collide with a record field.

    Raises:
        ValueError: naming the case and the key.
    """
    for key, value in meta.items():
        if not isinstance(key, str):
            raise ValueError(f"case {case_id!r}: meta keys must be strings; got {key!r}")
        if not isinstance(value, _SCALARS):
            raise ValueError(f"case {case_id!r}: meta[{key!r}] must be a flat scalar; got {type(value).__name__}")
        if key in FIELD_SET:
            raise ValueError(f"case {case_id!r}: meta key {key!r} collides with a record field")


def _plain(value: Any) -> Any:
    """Python scalars (numpy scalars unwrapped)."""
    return value.item() if isinstance(value, np.generic) else value


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_range(name: str, value: Any) -> Any:
    """``value`` when within field ``name``'s :data:`FIELD_RANGES` (NaN and None pass), else ValueError naming it."""
    bounds = FIELD_RANGES.get(name)
    if bounds is None or value is None or (isinstance(value, float) and math.isnan(value)):
        return value
    low, high = bounds
    slack = RANGE_SLACK if isinstance(value, float) else 0
    if (low is not None and value < low - slack) or (high is not None and value > high + slack):
        where = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"field {name!r} must be in {where}; got {value!r} (out of range: another unit, or not a "
                         "value this field can take)")
    return value


def _coerce(name: str, value: Any) -> Any:
    """``value`` as field ``name``'s type within its range, or ValueError naming the field (JSON and Parquet forms
    both accepted)."""
    return _check_range(name, _coerce_type(name, value))


def _coerce_type(name: str, value: Any) -> Any:
    """``value`` as field ``name``'s type, or ValueError naming the field."""
    kind = FIELD_TYPES[name]
    value = _plain(value)
    bad = ValueError(f"field {name!r} must be {kind}; got {value!r} ({type(value).__name__})")
    if kind.endswith("?"):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return None
        kind = kind[:-1]
    if kind == _STR:
        if not isinstance(value, str):
            raise bad
        return value
    if kind == _INT:
        if _is_int(value):
            return int(value)
        if isinstance(value, float) and value.is_integer():  # a Parquet int column with a None became float
            return int(value)
        raise bad
    if kind == _FLOAT:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float)):
            if value is None:  # JSON null for NaN written by another tool
                return float("nan")
            raise bad
        return float(value)
    if kind == _BOOL:
        if not isinstance(value, (bool, np.bool_)):
            raise bad
        return bool(value)
    seq = list(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if seq is None:
        raise bad
    if kind == "ints":
        if not all(_is_int(_plain(v)) for v in seq):
            raise bad
        return tuple(int(v) for v in seq)
    if kind == "strs":
        if not all(isinstance(v, str) for v in seq):
            raise bad
        return tuple(seq)
    # intervals: pairs of ints
    out = []
    for iv in seq:
        pair = list(iv) if isinstance(iv, (list, tuple, np.ndarray)) else None
        if pair is None or len(pair) != 2 or not all(_is_int(_plain(v)) for v in pair):
            raise bad
        out.append((int(pair[0]), int(pair[1])))
    return tuple(out)


def parse_line(line: str | bytes, meta_keys: Iterable[str] | None = None) -> Record:
    """Validate one stored part-file line against the schema and return its record.

    Args:
        line: one JSON line of a part file.
        meta_keys: the case's meta keys (its columns); a line holding a key that is neither a field nor one of them,
            or lacking one of them, is refused. ``None``: any flat scalar keys are taken as meta.

    Raises:
        ValueError: saying why the line is not a record (not JSON, not an object, a missing field, a field of the
            wrong type or out of its range, a meta value that is not a flat scalar, an unknown or missing key).
    """
    try:
        data = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"not JSON ({err.msg if hasattr(err, 'msg') else err})") from None
    record = Record.from_json(data)
    if meta_keys is not None:
        expected = set(meta_keys)
        unknown = sorted(k for k in record.meta if k not in expected)
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} (neither a record field nor a column of its case)")
        missing = sorted(expected - set(record.meta))
        if missing:
            raise ValueError(f"the case's column {missing[0]!r} is missing")
    return record


def records_frame(records: Iterable[Record]) -> pd.DataFrame:
    """A DataFrame of records, one row each: meta columns first (in order of first appearance), then every field.

    An empty input gives an empty frame with the field columns.
    """
    rows = [r.to_row() for r in records]
    meta: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k not in FIELD_SET:
                meta.setdefault(k)
    return pd.DataFrame(rows, columns=[*meta, *FIELD_NAMES])


def frame_records(df: pd.DataFrame) -> list[Record]:
    """The records of a DataFrame written by :func:`records_frame` (e.g. read back from ``records.parquet``).

    A meta column that only some records have is NaN for the others and is left out of their meta; in a frame that
    mixes such records, an integer meta column comes back as floats (the part files keep the exact values).

    Raises:
        ValueError: as :meth:`Record.from_row`, for the first row that is not a record.
    """
    return [Record.from_row({k: v for k, v in row.items() if not _missing_meta(k, v)})
            for row in df.to_dict("records")]


def _missing_meta(key: str, value: Any) -> bool:
    # A meta column that some cases lack reads back as NaN/None for them; it was never part of those records.
    return key not in FIELD_SET and (value is None or (isinstance(value, float) and math.isnan(value)))


def config_fields(lm, *, seed: int = 0, executor: str = "sequential", max_new_tokens: int = 64, eval_batch: int = 1,
                  options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The configuration fingerprint fields of :data:`CONFIG_FIELDS` for a run of ``lm`` with these settings.

    ``options`` is stored as its digest (models by their fingerprint, :func:`sur_lab.fingerprint.describe`). The
    scorer and parser are not part of it: they are applied to the stored answer text.

    Args:
        lm: a :class:`sur_lab.models.LoadedModel`.
        seed, executor, max_new_tokens, eval_batch, options: the run's settings.
    """
    return {
        **model_fingerprint(lm), "seed": int(seed), "executor": executor, "max_new_tokens": int(max_new_tokens),
        "decoding": DECODING, "eval_batch": int(eval_batch), "options": digest(dict(options or {})),
        "versions": versions(),
    }


def comparable_fields(record_or_row: Mapping[str, Any] | Record) -> dict[str, Any]:
    """Every field that two runs of the same sweep must reproduce: all but the timings and the measurement
    conditions (``workers``, ``threads``)."""
    data = record_or_row.to_row() if isinstance(record_or_row, Record) else dict(record_or_row)
    return {k: v for k, v in data.items() if k not in TIMING_FIELDS and k not in CONDITION_FIELDS}


__all__ = [
    "ANSWER_TIMING_FIELDS", "CONDITION_FIELDS", "CONFIG_FIELDS", "DECODING", "FIELD_NAMES", "FIELD_RANGES",
    "FIELD_TYPES",
    "FINGERPRINT_FIELDS", "NO_BUDGET", "Record", "TIMING_FIELDS", "check_meta", "comparable_fields", "config_fields",
    "frame_records", "parse_line", "record_key", "records_frame",
]

