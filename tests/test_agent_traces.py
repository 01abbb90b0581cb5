"""The agent-trace study (notebook 10): trace construction, the per-turn runner on a tiny float64 model with a real chat
template, and the tables and conclusion on hand-made runs."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from sur_lab.edits import chat_segments, tokenize_segments
from sur_lab.studies import agent_traces as at
from sur_lab.studies import get_study
from sur_lab.data.qa import Passage, QAExample
from sur_lab.sync import diff_tokens
from test_sync import chat_lm, qwen_tokenizer


def _examples(n: int) -> list[QAExample]:
    return [QAExample(f"q{i}", f"Who founded company {i}?", (f"Founder {i}",), "span",
                      (Passage(f"Gold {i}", f"Company {i} was founded by Founder {i} in the year {1900 + i}.", True),),
                      (Passage(f"Other {i}", f"An unrelated passage number {i} about rivers and hills.", False),),
                      "hotpotqa") for i in range(n)]


def _ids(tok, messages):
    return [i for seg in tokenize_segments(tok, chat_segments(tok, messages))[0] for i in seg]


def test_trace_edits_follow_the_schedule():
    tok = qwen_tokenizer()
    trace = at.build_trace(tok, _examples(6), max_doc_tokens=16)
    turns = trace["turns"]
    assert [t["edits"] for t in turns] == ["prefill", "append", "remove+append", "compact+plan+append",
                                           "compact+remove+append", "compact+append"]
    for t, turn in enumerate(turns):
        text = "\n".join(m["content"] for m in turn["messages"])
        assert turn["question"] == f"Who founded company {t}?" and turn["answers"] == [f"Founder {t}"]
        assert f"Founder {t}" in text  # the turn's supporting passage is in its prompt
    assert turns[1]["messages"][: len(turns[0]["messages"])] == turns[0]["messages"]  # turn 1 only appends
    lookups = [m["content"].split(":")[0] for m in turns[2]["messages"] if m["content"].startswith("Lookup")]
    assert lookups == ["Lookup 1", "Lookup 3"]  # the previous turn's lookup removed (superseded)
    assert turns[3]["messages"][2]["content"] == at.REWRITTEN and turns[2]["messages"][2]["content"] == at.PLAN
    summaries = [m["content"] for m in turns[3]["messages"] if m["content"].startswith("Search (summarised)")]
    assert summaries == ["Search (summarised): Gold 0."]  # the oldest search compacted to its titles


def test_trace_regions_from_the_token_diff():
    tok = qwen_tokenizer()
    turns = at.build_trace(tok, _examples(6), max_doc_tokens=16)["turns"]
    plans = [diff_tokens(_ids(tok, a["messages"]), _ids(tok, b["messages"])) for a, b in zip(turns, turns[1:])]
    assert plans[0].stale_rows == 0 and plans[0].inserted > 0  # turn 1: a pure append
    assert all(p.stale_rows > 0 for p in plans[1:])
    assert plans[1].first_change > plans[1].old_len / 2  # turn 2: a removal late in the cached prompt
    plan3 = plans[2]  # the plan rewrite lands near the start
    assert plan3.first_change < plan3.new_len / 4


def test_traces_read_development_files_only(monkeypatch):
    tok = qwen_tokenizer()
    splits = []

    def fake_load(ds, split="dev"):
        splits.append((ds, split))
        return _examples(20)

    monkeypatch.setattr(at, "load_qa", fake_load)
    p = at.params("smoke", n_traces=3, turns=2, datasets=["hotpotqa", "musique"])
    traces = at.build_traces(tok, p, seed=0)
    assert splits == [("hotpotqa", "dev"), ("musique", "dev")]
    assert len(traces) == 3 and all(len(t["turns"]) == 2 for t in traces)
    questions = [turn["question"] for t in traces for turn in t["turns"]]
    assert len(set(questions[:4])) == 4  # one source per turn within a dataset's selection


def test_bad_arguments_are_refused():
    tok = qwen_tokenizer()
    with pytest.raises(ValueError, match="examples"):
        at.build_trace(tok, _examples(1))
    with pytest.raises(ValueError, match="max_doc_tokens"):
        at.build_trace(tok, _examples(2), max_doc_tokens=4)
    with pytest.raises(ValueError, match="budgets"):
        at.default_paths([])
    with pytest.raises(ValueError, match="budgets"):
        at.default_paths([0])
    with pytest.raises(ValueError, match="workers"):
        at.sweep(None, workers=2)
    with pytest.raises(ValueError, match="turns"):
        at.build_traces(tok, at.params("smoke", turns=1))
    assert get_study("agent-traces") is at


def test_run_trace_on_a_tiny_model():
    """Re-prefill agrees with itself; prefix reuse recomputes exactly the rows from the first change and answers as
    re-prefill does (fp64); an append costs every incremental path only the new tokens; a 100 % sync answers as
    re-prefill does."""
    lm = chat_lm()
    trace = at.build_trace(lm.tokenizer, _examples(4), max_doc_tokens=12)
    paths = [at.TracePath("sync 100%", "SUR", 100.0, at.SyncPolicy(0, 1.0)), *at.default_paths([5])]
    df = at.run_traces(lm, [trace], paths, executor="sequential", max_new_tokens=3, progress=False)
    assert len(df) == 4 * len(paths)
    ref = df[df.path == at.REFERENCE]
    assert ref.agree.all() and ref.token_exact.all() and (ref.recomputed == ref.tokens).all()
    later = df[df.turn > 0]
    prefix = later[later.path == at.PREFIX]
    assert (prefix.recomputed == prefix.tokens - prefix.first_change).all() and prefix.token_exact.all()
    assert later[later.path == "sync 100%"].token_exact.all()
    append = later[(later.turn == 1) & (later.path != at.REFERENCE)]
    assert (append.region == "append").all() and (append.recomputed == append.inserted).all()
    repaired = later[(later.turn > 1) & (later.path == "sync 5%")]
    assert (repaired.sync_path == "repair").all()
    assert (repaired.allowance == np.ceil(repaired.stale_rows * 5 / 100)).all()
    last = df[df.turn == 3].set_index("path")
    assert last.loc[at.REFERENCE, "cost_ratio"] == 1.0
    assert last.loc[at.REFERENCE, "cum_recomputed"] == ref.tokens.sum()


class _Stopped(Exception):
    """A run stopped from outside (as a kernel interrupt would)."""


def test_sweep_resumes_after_an_interruption(tmp_path, monkeypatch):
    """A finished trace is on disk before the next starts: a run stopped in its second trace loses only that trace,
    the next call runs only what is missing and gives the uninterrupted table; a part made with other parameters is
    never read."""
    lm = chat_lm()
    traces = [at.build_trace(lm.tokenizer, _examples(3), max_doc_tokens=12) for _ in range(3)]
    for i, trace in enumerate(traces):
        trace["id"] = f"trace-{i}"
    monkeypatch.setattr(at, "build_traces", lambda tok, p, seed=0: [dict(t) for t in traces])
    real, calls, stop = at.run_trace, [], ["trace-1"]

    def counting(lm_, trace, *args, **kwargs):
        calls.append(trace["id"])
        if stop and trace["id"] == stop[0]:
            stop.clear()
            raise _Stopped  # the first run is stopped in its second trace
        return real(lm_, trace, *args, **kwargs)

    monkeypatch.setattr(at, "run_trace", counting)
    kw = dict(preset="smoke", out=tmp_path, executor="sequential", budgets=[5], max_new_tokens=2, progress=False)
    with pytest.raises(_Stopped):
        at.sweep(lm, **kw)
    assert not (tmp_path / at.TABLE_FILE).exists()
    assert len(list((tmp_path / "parts").glob("*.parquet"))) == 1  # trace-0 kept
    runs, where = at.sweep(lm, **kw)
    assert calls == ["trace-0", "trace-1", "trace-1", "trace-2"]  # trace-0 read back, not rerun
    assert list(runs.trace.unique()) == ["trace-0", "trace-1", "trace-2"]
    fresh, _ = at.sweep(lm, **{**kw, "out": tmp_path / "fresh"})
    pd.testing.assert_frame_equal(runs.drop(columns=["sync_ms", "query_ms", "ttft_ms", "cum_ttft_ms"]),
                                  fresh.drop(columns=["sync_ms", "query_ms", "ttft_ms", "cum_ttft_ms"]))
    calls.clear()
    at.sweep(lm, **{**kw, "max_new_tokens": 3})  # another fingerprint: no part of the first run is reused
    assert calls == ["trace-0", "trace-1", "trace-2"]
    assert len(list((tmp_path / "parts").glob("*.parquet"))) == 6


def _runs() -> pd.DataFrame:
    """Two traces, turns 0..2; turn 1 an append, turn 2 a first-half change where sync is 3x faster than prefix reuse
    but disagrees on one of the two traces."""
    rows = []
    for trace in ("a", "b"):
        for turn, region in ((0, "prefill"), (1, "append"), (2, "first half")):
            for path, ttft, rec in (("sync 5%", 100.0, 10), (at.PREFIX, 300.0, 50), (at.REFERENCE, 400.0, 80)):
                if turn == 1:
                    ttft, rec = (50.0, 5) if path != at.REFERENCE else (400.0, 80)
                if turn == 0:
                    ttft, rec = 400.0, 80
                agree = not (path == "sync 5%" and turn == 2 and trace == "b")
                rows.append({"trace": trace, "turn": turn, "path": path, "region": region, "ttft_ms": ttft,
                             "recomputed": rec, "agree": agree, "em": agree, "tokens": 80})
    return at.add_cumulative(pd.DataFrame(rows))


def test_tables_and_conclusion_on_hand_made_runs():
    runs = _runs()
    last = runs[(runs.turn == 2) & (runs.path == "sync 5%")]
    assert (last.cum_recomputed == 80 + 5 + 10).all() and np.allclose(last.cost_ratio, 95 / 240)
    regions = at.region_table(runs).set_index(["region", "path"])
    first = regions.loc[("first half", "sync 5%")]
    assert first.speedup == pytest.approx(3.0) and first.agree_pct == 50.0 and first.agree_diff_pp == -50.0
    assert math.isnan(first.speedup_lo)  # every ratio is 3: no interval, never a zero-width one
    assert first.losses == 1 and first.loss_upper_pct == pytest.approx(100 * 0.975**0.5, abs=1e-9)  # 1 of 2
    assert regions.loc[("append", "sync 5%")].speedup == pytest.approx(1.0)
    summary = at.summary_table(runs).set_index("path")
    assert summary.loc["sync 5%", "agree_pct"] == 75.0 and math.isclose(summary.loc["sync 5%", "cost_ratio"], 95 / 240)
    text = "\n".join(at.conclusion(at.region_table(runs), at.summary_table(runs), runs, n_boot=200))
    # Two traces decide nothing: a speed-up on both traces is not "faster" (no test on two clusters reaches 5 %),
    # and 0 losses in 2 appended turns bound the loss rate at 84 %, not 5 %.
    assert "primary (tested alone): 1 not separated" in text
    assert "sync 5% vs prefix reuse: not separated at this size (not shown faster), 1.73x" in text
    assert ("append: sync 5% loses re-prefill's answer that prefix reuse kept on 0 % (0 of 2 turns; 95 % CI 0 % to "
            "84 %): at most 5 % not shown at this size (upper bound 84 %)") in text
    assert "should not be used" not in text and "Not shown at this size" in text
    assert "without losing" not in text and "was faster" not in text
    with pytest.raises(ValueError, match="sync"):
        at.conclusion(at.region_table(runs), at.summary_table(runs), runs, sync="sync 7%")
    # One trace: each region has one turn, so no interval; the conclusion says so instead of printing "nan".
    one = runs[runs.trace == "a"]
    text = "\n".join(at.conclusion(at.region_table(one), at.summary_table(one), one, n_boot=200))
    assert "nan" not in text and "no interval" in text and "first half (1 turn)" in text
    smoke = "\n".join(at.conclusion(at.region_table(runs), at.summary_table(runs), runs, n_boot=200, decide=False))
    assert "not decided at this size" in smoke and "should not be used" not in smoke
    with pytest.raises(ValueError, match="against"):
        at.region_table(runs, against="nope")


def test_the_conclusion_decides_with_enough_traces():
    rows = []
    rng = np.random.default_rng(0)
    for t in range(60):
        for turn, region in ((1, "append"), (2, "first half")):
            for path in ("sync 5%", at.PREFIX, at.REFERENCE):
                ttft = {"sync 5%": 100.0, at.PREFIX: 300.0, at.REFERENCE: 400.0}[path] * rng.uniform(0.9, 1.1)
                if region == "append" and path != at.REFERENCE:
                    ttft = 50.0 * rng.uniform(0.9, 1.1)
                lost = path == "sync 5%" and region == "first half" and t < 20  # a third of the first-half turns
                rows.append({"trace": f"t{t}", "turn": turn, "path": path, "region": region, "ttft_ms": ttft,
                             "recomputed": 10, "agree": not lost, "em": not lost, "tokens": 80})
    runs = at.add_cumulative(pd.DataFrame(rows))
    text = "\n".join(at.conclusion(at.region_table(runs), at.summary_table(runs), runs, n_boot=500))
    assert "sync 5% is faster than prefix reuse" in text  # the primary, over every later turn
    assert "first half: a loss of agreement above 5 points is shown" in text
    assert "Not shown at this size (faster, or within 5 points of agreement) in: append." in text
