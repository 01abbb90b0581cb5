"""The record store of one sweep folder: part files, the fingerprint check, ``sweep.json`` and ``records.parquet``.

On-disk layout under ``out_dir`` (the part files are the source of truth, written as records finish):

- ``parts/<case>.jsonl``: one JSON record per line (:meth:`sur_lab.sweeps.record.Record.to_line`), appended and
  fsynced as soon as the record is complete, so an interrupted sweep loses at most the records in flight.
- ``sweep.json``: the configuration of the last call and its fingerprint (written atomically).
- ``records.parquet``: every requested record, consolidated (atomically) when the sweep finishes.
- ``.sweep.lock``: held for the whole call; a second concurrent sweep of the folder fails at once.

Reading (:meth:`SweepStore.read`) validates every line against the record schema
(:func:`sur_lab.sweeps.record.parse_line`: types, ranges, and no key beyond the case's columns). A line that is not a
record (torn by a crash, edited by hand, written by an older version, a value out of its range, an unknown key) is
reported in a ``UserWarning`` naming the file, the line number and what is wrong, dropped from the part file (the
valid lines are kept byte for byte, the file is rewritten atomically) and its record is recomputed; it never crashes
a resume. A valid record made with another configuration is different: resuming would mix results, so
:func:`check_fingerprint` (the one fingerprint check, used by every scheduler) raises a ``ValueError`` naming the
folder, the case and the first differing field. :func:`sweep_folder` names a folder per model fingerprint, so that a
run with another model, dtype or device starts a new folder instead.

A ``records.parquet`` whose cases have no part files (``parts/`` deleted, or copied without it) is the only copy of
those records: before anything can overwrite it, :meth:`SweepStore.adopt_consolidated` checks its records against the
run's fingerprint and refuses a mismatch (``ValueError`` naming ``out_dir``); matching records are written back as
part files, so the run resumes them instead of losing them.

Keyed rows (:meth:`SweepStore.run_keyed`) are the store of the studies whose unit is not one sweep record: an agent
trace's turns, an agent episode's edits, an execution-path cell's decodes. A case there produces several plain rows
(mappings of JSON values), each named by its ``key`` fields (e.g. ``("turn", "path")``), in one computation that
cannot be split (a path's state at turn t depends on its turns before). The same folder layout holds them:

- ``parts/<case>.jsonl``: one line per row, ``{"case_id", "key", "fingerprint", "row"}``, the case's rows written
  together, atomically (:meth:`SweepStore.write_rows`): a case's rows are on disk whole or not at all, so an
  interrupted run loses only the case in flight and the next call resumes after the finished ones;
- ``sweep.json``: the fingerprint of the last call (:meth:`SweepStore.write_manifest`);
- the study's table (e.g. ``turns.parquet``), every case's rows in case order, written atomically at the end.

A stored case made with another fingerprint is refused by the same :func:`check_fingerprint` (``ValueError`` naming
the folder, the case and the first differing field); a part file that is not keyed rows of its case (torn, edited by
hand, another format) is reported in a ``UserWarning``, removed and its case recomputed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from sur_lab.paths import run_tag
from sur_lab.fingerprint import digest, first_difference, model_fingerprint
from sur_lab.paths import atomic_path, outputs_dir
from sur_lab.sweeps.record import Record, frame_records, parse_line, records_frame


def sweep_folder(name: str, lm, *, outputs: Path | None = None, **params: Any) -> Path:
    """A sweep folder named by the study, the parameters and the model's fingerprint, so that a run with another
    model, weights, dtype or device never resumes (or republishes) another's records.

    ``<outputs>/sweeps/<name>_<run_tag(params)>_<dtype>_<device>_w<weights hash, 8>``.

    Args:
        name: study prefix, e.g. ``"02_niah"``.
        lm: the model.
        outputs: outputs root (default :func:`sur_lab.paths.outputs_dir`).
        params: parameter values for the name (:func:`sur_lab.paths.run_tag`).
    """
    fp = model_fingerprint(lm)
    device = fp["device"].split(" ")[0].replace(":", "")
    tag = run_tag(**{**params, "dtype": fp["dtype"], "device": device, "w": fp["model_weights"][:8]})
    return (outputs or outputs_dir()) / "sweeps" / f"{name}_{tag}"


def part_name(case_id: str) -> str:
    """The part-file stem of a case: a file-name-safe prefix of ``case_id`` and 8 hex characters of its hash."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", case_id)[:80]
    return f"{safe}-{hashlib.sha1(case_id.encode()).hexdigest()[:8]}"


def check_fingerprint(stored: Iterable[Record | Mapping[str, Any]], expected: Mapping[str, Any], *,
                      out_dir: Path | str, case_id: str) -> None:
    """The one fingerprint check: every stored record of a case must match ``expected`` on each of its fields.

    Args:
        stored: the case's stored records (:class:`Record` objects, or the fingerprint mappings of keyed rows).
        expected: fingerprint field -> value the call would write (all of
            :data:`sur_lab.sweeps.record.FINGERPRINT_FIELDS` where known; a driver without the model passes the
            fields it knows and the workers check the rest).
        out_dir, case_id: for the message.

    Raises:
        ValueError: naming ``out_dir``, the case and the first differing field with both values.
    """
    for rec in stored:
        row = rec.to_json() if isinstance(rec, Record) else rec
        bad = first_difference(row, expected)
        if bad is not None:
            raise ValueError(
                f"out_dir={str(out_dir)!r} holds a record of case {case_id!r} made with another {bad} "
                f"({row.get(bad)!r} vs {expected[bad]!r} now); use a fresh out_dir (sweep_folder names one per "
                "model, dtype and device)"
            )


class FolderInUseError(RuntimeError):
    """Another process holds a sweep folder's lock (:meth:`SweepStore.lock`); the message names ``out_dir``."""


class SweepStore:
    """The records of one sweep folder (module docstring). Methods never raise on an invalid stored line.

    Args:
        out_dir: the sweep folder (created on first write).
    """

    def __init__(self, out_dir: Path | str) -> None:
        self.out_dir = Path(out_dir)
        self.parts = self.out_dir / "parts"

    def part_path(self, case_id: str) -> Path:
        """``parts/<part_name(case_id)>.jsonl``."""
        return self.parts / f"{part_name(case_id)}.jsonl"

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold ``out_dir/.sweep.lock`` for the block: two processes appending to the same part files would interleave
        records and race on ``records.parquet``, so a second concurrent sweep of one folder fails at once.

        Raises:
            FolderInUseError: (a ``RuntimeError``) naming ``out_dir`` when another process holds the lock (nothing is
                written).
        """
        self.out_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.out_dir / ".sweep.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise FolderInUseError(
                f"out_dir={str(self.out_dir)!r} is in use by another sweep (lock {lock.lock_file}); wait for it or use "
                "another folder"
            ) from None
        try:
            yield
        finally:
            lock.release()

    def read(self, case_id: str, meta_keys: Iterable[str] | None = None) -> dict[tuple[str, str, str], Record]:
        """The valid stored records of a case by :attr:`Record.key` (the last line wins for a repeated key).

        Lines that are not records of this case are reported (``UserWarning`` with the file, the line number and the
        reason), removed from the part file, and so recomputed by the sweep.

        Args:
            case_id: the case.
            meta_keys: the case's meta keys (:attr:`sur_lab.sweeps.Case.meta`): a line with a key beyond them and the
                record fields (or without one of them) is not a record of this case. ``None``: not checked.
        """
        path = self.part_path(case_id)
        if not path.exists():
            return {}
        data = path.read_bytes()
        lines = data.split(b"\n")
        torn = lines.pop() if lines else b""  # the text after the last newline: empty unless a write was torn
        out: dict[tuple[str, str, str], Record] = {}
        keep: list[bytes] = []
        problems = []
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                problems.append((lineno, "empty line"))
                continue
            try:
                rec = parse_line(line, meta_keys)
            except ValueError as err:
                problems.append((lineno, str(err)))
                continue
            if rec.case_id != case_id:
                problems.append((lineno, f"a record of case {rec.case_id!r}, not {case_id!r}"))
                continue
            out[rec.key] = rec
            keep.append(line)
        if torn:
            problems.append((len(lines) + 1, "torn (no line end: a write interrupted by a crash)"))
        for lineno, why in problems:
            warnings.warn(f"{path}:{lineno}: not a valid sweep record ({why}); it is dropped and recomputed",
                          UserWarning, stacklevel=2)
        if problems:
            with atomic_path(path) as tmp:
                tmp.write_bytes(b"".join(line + b"\n" for line in keep))
        return out

    def count(self, case_id: str) -> int:
        """Complete lines in the case's part file (a progress count; not validated)."""
        try:
            with self.part_path(case_id).open("rb") as fh:
                return sum(1 for line in fh if line.endswith(b"\n"))
        except FileNotFoundError:
            return 0

    def append(self, record: Record) -> None:
        """Append ``record`` to its case's part file and fsync it."""
        self.parts.mkdir(parents=True, exist_ok=True)
        with self.part_path(record.case_id).open("a", encoding="utf-8") as fh:
            fh.write(record.to_line() + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def adopt_consolidated(self, expected: Mapping[str, Any]) -> int:
        """Check the records of ``records.parquet`` whose cases have no part file against ``expected`` and write them
        back as part files (module docstring); call it under :meth:`lock`, before reading the cases.

        Args:
            expected: configuration fingerprint fields (:data:`sur_lab.sweeps.record.CONFIG_FIELDS` or the subset a
                driver knows) every such record must match; the case fingerprints are checked when the cases are
                read (:func:`check_fingerprint`).

        Returns:
            Records written back (0 when there is no ``records.parquet`` or every case in it has its part file).

        Raises:
            ValueError: naming ``out_dir`` when ``records.parquet`` cannot be read, or holds such a record made with
                another configuration (the first differing field, with both values): nothing is written then, and the
                sweep does not run (it would overwrite the only copy).
        """
        path = self.out_dir / "records.parquet"
        if not path.is_file():
            return 0
        try:
            frame = pd.read_parquet(path)
            if "case_id" not in frame.columns:
                raise ValueError("it has no case_id column")
            lost = [cid for cid in dict.fromkeys(frame["case_id"]) if not self.part_path(str(cid)).exists()]
            orphans = frame_records(frame[frame["case_id"].isin(lost)]) if lost else []
        except (OSError, ValueError) as err:
            raise ValueError(
                f"out_dir={str(self.out_dir)!r}: records.parquet cannot be read as records ({err}); it may be the only "
                "copy of records no part file holds, so it is not overwritten: move it away or use a fresh out_dir"
            ) from None
        by_case: dict[str, list[Record]] = {}
        for rec in orphans:
            by_case.setdefault(rec.case_id, []).append(rec)
        for case_id, recs in by_case.items():
            try:
                check_fingerprint(recs, expected, out_dir=self.out_dir, case_id=case_id)
            except ValueError as err:
                raise ValueError(f"{err}. That record is in records.parquet and no part file holds it: the only "
                                 "copy, so it is not overwritten (or move records.parquet away)") from None
        self.parts.mkdir(parents=True, exist_ok=True)
        for case_id, recs in by_case.items():
            with atomic_path(self.part_path(case_id)) as tmp:
                tmp.write_text("".join(r.to_line() + "\n" for r in recs), encoding="utf-8")
        return len(orphans)

    def write_manifest(self, config: Mapping[str, Any], **details: Any) -> None:
        """Write ``sweep.json`` atomically: the configuration, its digest (``fingerprint``) and ``details`` (methods,
        budgets, cases, timed cases, workers...)."""
        self.write_json("sweep.json", {**config, "fingerprint": digest(dict(config)), **details}, indent=1)

    def write_json(self, name: str, value: Any, *, indent: int | None = None) -> Path:
        """Write ``value`` as JSON to ``out_dir/name`` atomically (the folder's one writer of whole files: a reader
        sees the previous file or the complete new one); returns the path. Values that are not JSON are written as
        ``str``."""
        return self._write(name, lambda tmp: tmp.write_text(json.dumps(value, indent=indent, default=str),
                                                            encoding="utf-8"))

    def write_table(self, name: str, frame: pd.DataFrame) -> Path:
        """Write ``frame`` as Parquet to ``out_dir/name`` atomically (no index); returns the path."""
        return self._write(name, lambda tmp: frame.to_parquet(tmp, index=False))

    def _write(self, name: str, write: Callable[[Path], Any]) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / name
        with atomic_path(path) as tmp:
            write(tmp)
        return path

    # -- keyed rows (module docstring) ---------------------------------------------------------------------------

    def write_rows(self, case_id: str, rows: Sequence[Mapping[str, Any]], *, key: Sequence[str],
                   fingerprint: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Store a case's rows, all at once and atomically (its part file is replaced whole), and return them as they
        read back (JSON values: NumPy scalars become Python numbers, arrays and tuples lists; NaN kept).

        Args:
            case_id: the case (a non-empty string).
            rows: the case's rows (>= 1 mappings of column -> JSON value).
            key: the columns that name a row within its case (>= 1); no two rows may share their values.
            fingerprint: field -> JSON value (finite floats): what the rows depend on (checked on read by
                :func:`check_fingerprint`).

        Raises:
            ValueError: naming ``case_id`` (empty or not a string), ``rows`` (empty, a row that is not a mapping, lacks
                a ``key`` column, repeats another row's key, or holds a value that is not JSON), ``key`` (empty or a
                string) or ``fingerprint`` (not a mapping of JSON values, or a NaN in it); nothing is written then.
        """
        _check_case_id(case_id)
        key = _check_key(key)
        if not isinstance(fingerprint, Mapping):
            raise ValueError(f"fingerprint must be a mapping of field -> JSON value, not {type(fingerprint).__name__}")
        fp = _json_value(dict(fingerprint), "fingerprint", finite=True)
        if isinstance(rows, (str, bytes, Mapping)) or not len(rows):
            raise ValueError(f"rows of case {case_id!r} must be a non-empty sequence of mappings")
        lines, seen = [], set()
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise ValueError(f"rows[{i}] of case {case_id!r} is a {type(row).__name__}, not a mapping")
            missing = [k for k in key if k not in row]
            if missing:
                raise ValueError(f"rows[{i}] of case {case_id!r} lacks the key column(s) {missing}")
            plain = _json_value(dict(row), f"rows[{i}] of case {case_id!r}")
            row_key = [plain[k] for k in key]
            if json.dumps(row_key) in seen:
                raise ValueError(f"rows[{i}] of case {case_id!r} repeats the key {dict(zip(key, row_key))}")
            seen.add(json.dumps(row_key))
            lines.append(json.dumps({"case_id": case_id, "key": row_key, "fingerprint": fp, "row": plain},
                                    allow_nan=True))
        self.parts.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.part_path(case_id)) as tmp:
            with tmp.open("w", encoding="utf-8") as fh:
                fh.write("".join(line + "\n" for line in lines))
                fh.flush()
                os.fsync(fh.fileno())
        return [json.loads(line)["row"] for line in lines]

    def read_rows(self, case_id: str, *, key: Sequence[str],
                  fingerprint: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        """A case's stored rows in the order written, or ``None`` when the case has none (never run, interrupted
        before its write, or its part file was not keyed rows of this case: reported in a ``UserWarning`` naming the
        file and the reason, removed, so the case is recomputed).

        Args:
            case_id, key: as :meth:`write_rows`.
            fingerprint: what the rows must have been made with.

        Raises:
            ValueError: from :func:`check_fingerprint`, naming ``out_dir``, the case and the first differing field,
                when the stored rows were made with another fingerprint (nothing is removed: use a fresh folder);
                naming ``case_id`` or ``key`` when invalid.
        """
        _check_case_id(case_id)
        key = _check_key(key)
        path = self.part_path(case_id)
        if not path.exists():
            return None
        rows, fps, why = [], [], None
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            why = "no line end at the end of the file (a write interrupted by a crash)"
        for lineno, line in enumerate(data.split(b"\n")[:-1], start=1):
            if why:
                break
            try:
                obj = json.loads(line)
            except ValueError as err:
                why = f"line {lineno} is not JSON ({err})"
                break
            if not (isinstance(obj, dict) and set(obj) == {"case_id", "key", "fingerprint", "row"}
                    and isinstance(obj["row"], dict) and isinstance(obj["fingerprint"], dict)):
                why = f"line {lineno} is not a keyed row (a sweep record, or another format)"
            elif obj["case_id"] != case_id:
                why = f"line {lineno} is a row of case {obj['case_id']!r}, not {case_id!r}"
            elif obj["key"] != [obj["row"].get(k) for k in key]:
                why = f"line {lineno} is keyed by {obj['key']!r}, not by the row's {list(key)} values"
            else:
                rows.append(obj["row"])
                fps.append(obj["fingerprint"])
        if why is None and not rows:
            why = "no rows"
        if why is not None:
            warnings.warn(f"{path}: not the keyed rows of case {case_id!r} ({why}); it is removed and the case "
                          "recomputed", UserWarning, stacklevel=2)
            path.unlink(missing_ok=True)
            return None
        expected = _json_value(dict(fingerprint), "fingerprint", finite=True)
        check_fingerprint(fps, expected, out_dir=self.out_dir, case_id=case_id)
        return rows

    def run_keyed(self, cases: Mapping[str, Any], compute: Callable[[Any], Sequence[Mapping[str, Any]]], *,
                  key: Sequence[str], fingerprint: Mapping[str, Any],
                  case_fingerprint: Callable[[Any], Mapping[str, Any]] | None = None, table: str,
                  finish: Callable[[pd.DataFrame], pd.DataFrame] | None = None,
                  details: Mapping[str, Any] | None = None, progress: bool = False,
                  desc: str = "cases") -> pd.DataFrame:
        """The one resume loop of keyed rows: under :meth:`lock`, each case's stored rows are read back
        (:meth:`read_rows`) or computed (``compute(case)``) and stored at once (:meth:`write_rows`); then every
        case's rows, in the order of ``cases``, go through ``finish`` (e.g. cumulative columns) and are written to
        ``out_dir/table`` (:meth:`write_table`), the fingerprint to ``sweep.json``. A fresh run and a resumed one
        return equal frames: both are built from the rows as they read back.

        Args:
            cases: case id -> case (anything ``compute`` takes), in table order.
            compute: a case's rows (see :meth:`write_rows`).
            key: the columns naming a row within its case.
            fingerprint: the fields every stored row must match (model, parameters, versions...).
            case_fingerprint: extra fields per case (e.g. a digest of the case's content), merged over
                ``fingerprint``.
            table: the table's file name (``.parquet``).
            finish: the frame of every case's rows -> the table (default: the frame itself).
            details: written to ``sweep.json`` beside the fingerprint.
            progress: a progress bar over the cases to compute. desc: its label.

        Returns:
            The table: every case's rows as one DataFrame (one row per stored row; columns in first-seen order),
            through ``finish``.

        Raises:
            ValueError: naming ``table`` (not a ``.parquet`` name without a folder), ``cases`` (empty) or, from
                :meth:`read_rows`, a stored case made with another fingerprint (before anything is computed); from
                :meth:`write_rows`, bad rows.
            FolderInUseError: another process holds the folder (:meth:`lock`).
        """
        if not isinstance(table, str) or not table.endswith(".parquet") or Path(table).name != table:
            raise ValueError(f"table={table!r} must be a file name ending in .parquet")
        if not len(cases):
            raise ValueError("cases is empty; give at least one case")
        key = _check_key(key)

        def fp_of(case: Any) -> dict[str, Any]:
            return {**fingerprint, **(case_fingerprint(case) if case_fingerprint else {})}

        with self.lock():
            stored = {cid: self.read_rows(cid, key=key, fingerprint=fp_of(case)) for cid, case in cases.items()}
            todo = [cid for cid, rows in stored.items() if rows is None]
            if progress and len(todo) < len(cases):
                print(f"{len(cases) - len(todo)} of {len(cases)} {desc} read back from {self.parts}", flush=True)
            for cid in tqdm(todo, desc=desc, disable=not progress):
                stored[cid] = self.write_rows(cid, compute(cases[cid]), key=key, fingerprint=fp_of(cases[cid]))
            frame = pd.DataFrame([row for cid in cases for row in stored[cid]])
            if finish is not None:
                frame = finish(frame)
            self.write_manifest(dict(fingerprint), cases=list(cases), key=list(key), table=table, **(details or {}))
            self.write_table(table, frame)
        return frame

    def consolidate(self, case_ids: Sequence[str], keys: Sequence[tuple[str, str, str]]) -> pd.DataFrame:
        """The requested records in order (cases, then ``keys``), as a DataFrame also written atomically to
        ``records.parquet``. Records missing from the part files are left out."""
        rows = []
        for cid in case_ids:
            recs = self.read(cid)
            rows.extend(recs[k] for k in keys if k in recs)
        df = records_frame(rows)
        self.write_table("records.parquet", df)
        return df


def _check_case_id(case_id: Any) -> None:
    if not isinstance(case_id, str) or not case_id:
        raise ValueError(f"case_id={case_id!r} must be a non-empty string")


def _check_key(key: Any) -> tuple[str, ...]:
    if isinstance(key, str) or not isinstance(key, Sequence) or not key or not all(isinstance(k, str) for k in key):
        raise ValueError(f"key={key!r} must be a non-empty sequence of column names (e.g. ('turn', 'path'))")
    return tuple(key)


def _json_value(value: Any, name: str, *, finite: bool = False) -> Any:
    """``value`` as plain JSON values: NumPy scalars as Python numbers, arrays and tuples as lists, mapping keys as
    strings; NaN and infinities kept (written as ``NaN``/``Infinity``, read back by :mod:`json`).

    Raises:
        ValueError: naming ``name`` and the type of a value that is not JSON; with ``finite`` (fingerprints: NaN never
            equals itself, so a stored NaN would never match), naming a NaN or infinite float.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if finite and not math.isfinite(value):
            raise ValueError(f"{name} holds {value!r}; a fingerprint's floats must be finite (digest the value)")
        return float(value)
    if isinstance(value, np.generic):
        return _json_value(value.item(), name, finite=finite)
    if isinstance(value, np.ndarray):
        return _json_value(value.tolist(), name, finite=finite)
    if isinstance(value, Mapping):
        return {str(k): _json_value(v, name, finite=finite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v, name, finite=finite) for v in value]
    raise ValueError(f"{name} holds a {type(value).__name__} ({value!r:.80}), not a JSON value")


def read_records(out_dir: Path | str) -> pd.DataFrame:
    """``out_dir/records.parquet`` as a DataFrame (the consolidated records of a finished sweep).

    Raises:
        FileNotFoundError: naming the file when the sweep has not finished there.
    """
    path = Path(out_dir) / "records.parquet"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run the sweep (it resumes what is in {path.parent}/parts)")
    return pd.read_parquet(path)


__all__ = ["FolderInUseError", "SweepStore", "check_fingerprint", "part_name", "read_records", "sweep_folder"]
