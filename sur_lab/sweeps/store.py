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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

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
        params: parameter values for the name (:func:`sur_lab.analysis.plotting.run_tag`).
    """
    from sur_lab.analysis.plotting import run_tag

    fp = model_fingerprint(lm)
    device = fp["device"].split(" ")[0].replace(":", "")
    tag = run_tag(**{**params, "dtype": fp["dtype"], "device": device, "w": fp["model_weights"][:8]})
    return (outputs or outputs_dir()) / "sweeps" / f"{name}_{tag}"


def part_name(case_id: str) -> str:
    """The part-file stem of a case: a file-name-safe prefix of ``case_id`` and 8 hex characters of its hash."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", case_id)[:80]
    return f"{safe}-{hashlib.sha1(case_id.encode()).hexdigest()[:8]}"


def check_fingerprint(stored: Iterable[Record], expected: Mapping[str, Any], *, out_dir: Path | str,
                      case_id: str) -> None:
    """The one fingerprint check: every stored record of a case must match ``expected`` on each of its fields.

    Args:
        stored: the case's stored records.
        expected: fingerprint field -> value the call would write (all of
            :data:`sur_lab.sweeps.record.FINGERPRINT_FIELDS` where known; a driver without the model passes the
            fields it knows and the workers check the rest).
        out_dir, case_id: for the message.

    Raises:
        ValueError: naming ``out_dir``, the case and the first differing field with both values.
    """
    for rec in stored:
        row = rec.to_json()
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
        from filelock import FileLock, Timeout

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
        self.out_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps({**config, "fingerprint": digest(dict(config)), **details}, indent=1, default=str)
        with atomic_path(self.out_dir / "sweep.json") as tmp:
            tmp.write_text(text, encoding="utf-8")

    def consolidate(self, case_ids: Sequence[str], keys: Sequence[tuple[str, str, str]]) -> pd.DataFrame:
        """The requested records in order (cases, then ``keys``), as a DataFrame also written atomically to
        ``records.parquet``. Records missing from the part files are left out."""
        rows = []
        for cid in case_ids:
            recs = self.read(cid)
            rows.extend(recs[k] for k in keys if k in recs)
        df = records_frame(rows)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.out_dir / "records.parquet") as tmp:
            df.to_parquet(tmp, index=False)
        return df


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
