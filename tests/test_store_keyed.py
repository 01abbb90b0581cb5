"""Keyed rows of the one sweep store (sur_lab.sweeps.store, issue 39 item 4): a case's rows written whole and
atomically, read back with the one fingerprint check, and the one resume loop (``SweepStore.run_keyed``)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pandas as pd
import pytest

from sur_lab.sweeps.store import SweepStore

FP = {"model": "tiny", "dtype": "float64", "params": {"turns": 3, "budgets": [2, 5]}}


def _rows(case: str, n: int = 3) -> list[dict]:
    return [{"turn": t, "path": p, "case": case, "ms": 0.1 * t + (p == "b"), "nan": float("nan"), "ids": [t, 7],
             "ok": t % 2 == 0} for t in range(n) for p in ("a", "b")]


class _Stopped(Exception):
    """A run stopped from outside."""


def test_keyed_rows_round_trip(tmp_path):
    """Rows read back equal what was written, as JSON values: NumPy scalars and arrays become Python numbers and
    lists, NaN stays NaN; the case's order is kept."""
    store = SweepStore(tmp_path)
    rows = [{"turn": np.int64(0), "path": "a", "x": np.float32(0.25), "y": np.float64(1 / 3), "z": np.bool_(True),
             "v": np.arange(3), "t": (1, 2), "n": float("nan"), "s": None},
            {"turn": 1, "path": "a", "x": 0.5, "y": 2.0, "z": False, "v": [], "t": [], "n": 1.5, "s": "x"}]
    back = store.write_rows("trace/0", rows, key=("turn", "path"), fingerprint=FP)
    read = store.read_rows("trace/0", key=("turn", "path"), fingerprint=FP)
    assert json.dumps(back) == json.dumps(read)  # write_rows returns the rows as they read back (NaN != NaN)
    assert [type(read[0][k]) for k in ("turn", "x", "y", "z", "v", "t")] == [int, float, float, bool, list, list]
    assert read[0]["x"] == 0.25 and read[0]["y"] == 1 / 3 and read[0]["v"] == [0, 1, 2] and read[0]["s"] is None
    assert math.isnan(read[0]["n"]) and read[1]["n"] == 1.5 and read[1]["turn"] == 1
    assert store.read_rows("trace/1", key=("turn", "path"), fingerprint=FP) is None  # never written
    lines = store.part_path("trace/0").read_text().splitlines()
    assert [json.loads(line)["key"] for line in lines] == [[0, "a"], [1, "a"]]


def test_run_keyed_resumes_after_an_interruption(tmp_path):
    """A run stopped in its second case keeps the first whole (and nothing of the second); the next call computes
    only what is missing, and its table equals an uninterrupted run's and the stored table."""
    cases = {f"c{i}": f"c{i}" for i in range(3)}
    calls = []

    def compute(case, stop=None):
        calls.append(case)
        if case == stop:
            raise _Stopped
        return _rows(case)

    kw = dict(key=("turn", "path"), fingerprint=FP, table="t.parquet")
    store = SweepStore(tmp_path / "run")
    with pytest.raises(_Stopped):
        store.run_keyed(cases, lambda c: compute(c, stop="c1"), **kw)
    assert sorted(p.name[:2] for p in store.parts.iterdir()) == ["c0"] and not (store.out_dir / "t.parquet").exists()
    table = store.run_keyed(cases, compute, **kw)
    assert calls == ["c0", "c1", "c1", "c2"]
    fresh = SweepStore(tmp_path / "fresh").run_keyed(cases, compute, **kw)
    pd.testing.assert_frame_equal(table, fresh)
    pd.testing.assert_frame_equal(table, pd.read_parquet(store.out_dir / "t.parquet"))
    assert list(table["case"]) == [c for c in cases for _ in range(6)] and table["nan"].isna().all()
    assert json.loads((store.out_dir / "sweep.json").read_text())["cases"] == list(cases)
    calls.clear()
    done = store.run_keyed(cases, compute, finish=lambda df: df.assign(total=df["ms"].cumsum()), **kw)
    assert calls == [] and done["total"].iloc[-1] == pytest.approx(table["ms"].sum(), rel=1e-15)


def test_a_stored_case_with_another_fingerprint_is_refused(tmp_path):
    store = SweepStore(tmp_path)
    store.write_rows("c0", _rows("c0"), key=("turn", "path"), fingerprint=FP)
    other = {**FP, "params": {"turns": 3, "budgets": [2, 10]}}
    with pytest.raises(ValueError, match=f"out_dir='{tmp_path}'.*case 'c0'.*another params"):
        store.read_rows("c0", key=("turn", "path"), fingerprint=other)
    with pytest.raises(ValueError, match="another seed"):  # a field the stored rows lack differs too
        store.run_keyed({"c0": "c0"}, _rows, key=("turn", "path"), fingerprint={**FP, "seed": 1}, table="t.parquet")
    with pytest.raises(ValueError, match="another case"):
        store.run_keyed({"c0": "c0"}, _rows, key=("turn", "path"), fingerprint=FP,
                        case_fingerprint=lambda c: {"case": "changed"}, table="t.parquet")
    kept = store.read_rows("c0", key=("turn", "path"), fingerprint=FP)  # refused, never removed
    assert json.dumps(kept) == json.dumps(_rows("c0"))


def test_no_partial_part_file_is_ever_visible(tmp_path, monkeypatch):
    """A write that fails (a crash before the rename) leaves no part file and no temporary file, and the previous
    rows of the case stay whole; a torn or foreign part file is reported, removed and its case recomputed."""
    store = SweepStore(tmp_path)
    store.write_rows("c0", _rows("c0", 2), key=("turn", "path"), fingerprint=FP)
    before = store.part_path("c0").read_bytes()

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        store.write_rows("c0", _rows("c0", 3), key=("turn", "path"), fingerprint=FP)
    with pytest.raises(OSError, match="disk full"):
        store.write_rows("c1", _rows("c1"), key=("turn", "path"), fingerprint=FP)
    monkeypatch.undo()
    assert sorted(p.name for p in store.parts.iterdir()) == [store.part_path("c0").name]
    assert store.part_path("c0").read_bytes() == before
    store.part_path("c1").write_bytes(before[:-10])  # torn: no line end
    with pytest.warns(UserWarning, match="c1.*no line end"):
        assert store.read_rows("c1", key=("turn", "path"), fingerprint=FP) is None
    assert not store.part_path("c1").exists()
    store.part_path("c1").write_bytes(before)  # another case's rows
    with pytest.warns(UserWarning, match="a row of case 'c0', not 'c1'"):
        table = store.run_keyed({"c1": "c1"}, _rows, key=("turn", "path"), fingerprint=FP, table="t.parquet")
    assert set(table["case"]) == {"c1"} and len(table) == 6


def test_bad_input_is_refused_naming_the_argument(tmp_path):
    store = SweepStore(tmp_path)
    key = ("turn", "path")
    cases = [
        (dict(case_id="", rows=_rows("c")), "case_id"),
        (dict(case_id="c", rows=[]), "rows"),
        (dict(case_id="c", rows=[("turn", 0)]), r"rows\[0\].*not a mapping"),
        (dict(case_id="c", rows=[{"turn": 0}]), r"rows\[0\].*lacks the key column\(s\) \['path'\]"),
        (dict(case_id="c", rows=[{"turn": 0, "path": "a"}] * 2), r"rows\[1\].*repeats the key"),
        (dict(case_id="c", rows=[{"turn": 0, "path": "a", "x": object()}]), r"rows\[0\].*object.*not a JSON value"),
        (dict(case_id="c", rows=_rows("c"), key="turn"), "key="),
        (dict(case_id="c", rows=_rows("c"), key=()), "key="),
        (dict(case_id="c", rows=_rows("c"), fingerprint={"x": float("nan")}), "fingerprint.*finite"),
        (dict(case_id="c", rows=_rows("c"), fingerprint=[1]), "fingerprint must be a mapping"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            store.write_rows(**{"key": key, "fingerprint": FP, **kw})
    with pytest.raises(ValueError, match="table="):
        store.run_keyed({"c": "c"}, _rows, key=key, fingerprint=FP, table="sub/t.parquet")
    with pytest.raises(ValueError, match="cases is empty"):
        store.run_keyed({}, _rows, key=key, fingerprint=FP, table="t.parquet")
    assert not store.parts.exists()  # nothing written
