"""The agent-trace study (notebook 10): trace construction, the per-turn runner on a tiny float64 model with a real chat
template, and the tables and conclusion on hand-made runs."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from sur_lab.analysis.scoring import exact_match
from sur_lab.edits import chat_segments, tokenize_segments
from sur_lab.studies import agent_traces as at
from sur_lab.studies import get_study
from sur_lab.data.qa import Passage, QAExample, load_qa
from sur_lab.sync import SyncPolicy, diff_tokens
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
    assert [t["kind"] for t in turns] == ["new", "new", "reask-removed", "format", "reask-compacted", "combine"]
    assert [t["asks"] for t in turns] == [[0], [1], [1], [3], [1], [3, 4]]
    for t, turn in enumerate(turns):
        text = "\n".join(m["content"] for m in turn["messages"])
        for k in turn["asks"]:
            assert f"Who founded company {k}?" in turn["question"]
        assert turn["format"] == (t >= 3)
        if turn["kind"] in ("new", "format"):
            assert f"Founder {t}" in text  # the turn's supporting passage is in its prompt
    assert turns[1]["messages"][: len(turns[0]["messages"])] == turns[0]["messages"]  # turn 1 only appends
    lookups = [m["content"].split(":")[0] for m in turns[2]["messages"] if m["content"].startswith("Lookup")]
    assert lookups == ["Lookup 1", "Lookup 3"]  # the previous turn's lookup removed (superseded)
    assert turns[3]["messages"][2]["content"] == at.REWRITTEN and turns[2]["messages"][2]["content"] == at.PLAN
    summaries = [m["content"] for m in turns[3]["messages"] if "(summarised)" in m["content"]]
    assert summaries == ["Search 1 (summarised): Gold 0."]  # the oldest search compacted to its titles


def test_question_kinds_follow_the_edits():
    assert at.question_kinds(8) == ["new", "new", "reask-removed", "reask-compacted", "format", "combine",
                                    "reask-removed", "reask-compacted"]
    assert at.question_kinds(2) == ["new", "format"]
    for turns in (6, 8, 12):
        assert set(at.question_kinds(turns)) == set(at.QUESTION_KINDS)  # every kind at the default and paper sizes
    for bad in (1, 2.0, True):
        with pytest.raises(ValueError, match="turns"):
            at.question_kinds(bad)


def _own_title_examples(n: int) -> list[QAExample]:
    """As :func:`_examples`, but source 0's answer is its passage's title, so it survives the compaction."""
    out = _examples(n)
    out[0] = QAExample("q0", "Which firm did Founder 0 start?", ("Gold 0",), "span",
                       (Passage("Gold 0", "Gold 0 was started by Founder 0 in the year 1900.", True),),
                       (Passage("Other 0", "An unrelated passage number 0 about rivers and hills.", False),),
                       "hotpotqa")
    return out


def test_gold_is_reachable_only_from_the_stated_text():
    """Each question's gold comes from the tool outputs it names, as they stand in that turn's prompt: a re-asked
    question after a removal from the surviving search output downstream of it; after a compaction from the summary
    when the answer is a title, else "unknown" (and then the answer is nowhere in the prompt); a combined question
    from two earlier outputs; and from the plan rewrite on every gold carries the new answer format."""
    from sur_lab.analysis.scoring import normalize_answer

    tok = qwen_tokenizer()
    examples = _own_title_examples(8)
    turns = at.build_trace(tok, examples, max_doc_tokens=32)["turns"]
    assert [t["kind"] for t in turns] == at.question_kinds(8)
    for t, turn in enumerate(turns):
        prefix = f"{at.FORMAT_PREFIX} " if t >= 4 else ""
        heads = [e.capitalize() + ":" for e in turn["evidence"]]  # "search 2" -> the output "Search 2: ..."
        stated = [m["content"] for h in heads for m in turn["messages"] if m["content"].startswith(h)]
        assert len(stated) == len(turn["asks"])
        others = [m["content"] for m in turn["messages"] if m["content"] not in stated]
        parts = []
        for k, text in zip(turn["asks"], stated):
            answer = normalize_answer(examples[k].answers[0])
            elsewhere = any(answer in normalize_answer(o) for o in others)
            assert not elsewhere, (t, k)  # nowhere but in the stated output (or nowhere at all)
            if answer in normalize_answer(text):
                parts.append(examples[k].answers[0])
            else:
                parts.append("unknown")
        want = prefix + "; ".join(parts)
        assert turn["answers"][0] == want, (t, turn["answers"][0])
        assert turn["known"] == ("unknown" not in parts)
        if "unknown" in parts:
            assert set(turn["answers"]) >= {prefix + "; ".join(p if p != "unknown" else "none" for p in parts)}
    by_kind = {t["kind"]: t for t in turns[::-1]}  # the first turn of each kind
    assert turns[2]["evidence"] == ["search 2"] and turns[2]["known"]  # lookup 2 removed, search 2 survives after it
    assert turns[3]["evidence"] == ["search 1 (summarised)"] and turns[3]["answers"][0] == "Gold 0"  # from the title
    assert turns[7]["evidence"] == ["search 5 (summarised)"] and turns[7]["answers"][0] == "Final: unknown"
    assert by_kind["combine"]["answers"][0] == "Final: Founder 3; Founder 4"
    assert by_kind["format"]["answers"][0] == "Final: Founder 4"
    assert at.reachable(["yes"], "Search (summarised): A; B.", full=False) is False
    assert at.reachable(["yes"], "Search 1:\nTitle: A", full=True) is True
    assert at.reachable(["Founder 1"], "Founder 12 was here", full=True) is False  # whole words only


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

    monkeypatch.setattr(at.cases, "load_qa", fake_load)  # where build_traces looks it up
    p = at.STUDY.params("smoke", n_traces=3, turns=2, datasets=["hotpotqa", "musique"])
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
        at.STUDY.sweep(None, workers=2)
    with pytest.raises(ValueError, match="turns"):
        at.build_traces(tok, at.STUDY.params("smoke", turns=1))
    with pytest.raises(ValueError, match="datasets"):
        at.build_traces(tok, at.STUDY.params("smoke", datasets=["hotpotqa", "iirc"]))
    with pytest.raises(ValueError, match="by"):
        at.comparison_table(_runs(), "turn")
    with pytest.raises(ValueError, match="sync"):
        at.primary_table(_runs(), sync="sync 7%")
    assert get_study("agent-traces") is at.STUDY


def test_run_trace_on_a_tiny_model():
    """Re-prefill agrees with itself; prefix reuse recomputes exactly the rows from the first change and answers as
    re-prefill does (fp64); an append costs every incremental path only the new tokens; a 100 % sync answers as
    re-prefill does."""
    lm = chat_lm()
    trace = at.build_trace(lm.tokenizer, _examples(4), max_doc_tokens=12)
    paths = [at.TracePath("sync 100%", "SUR", 100.0, SyncPolicy(0, 1.0)), *at.default_paths([5])]
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
    assert list(ref.kind) == at.question_kinds(4) and list(ref.plan_format) == [False, False, True, True]
    gold = {t: turn["answers"] for t, turn in enumerate(trace["turns"])}
    assert all(r.em == exact_match(r.prediction, gold[r.turn]) for r in df.itertuples())  # EM against the turn's gold
    last = df[df.turn == 3].set_index("path")
    assert last.loc[at.REFERENCE, "cost_ratio"] == 1.0
    assert last.loc[at.REFERENCE, "cum_recomputed"] == ref.tokens.sum()


class _Stopped(Exception):
    """A run stopped from outside (as a kernel interrupt would)."""


def test_sweep_resumes_after_an_interruption(tmp_path, monkeypatch):
    """A finished trace is on disk before the next starts: a run stopped in its second trace loses only that trace,
    the next call runs only what is missing and gives the uninterrupted table; a trace stored with other parameters
    is refused, naming the folder and the parameters."""
    lm = chat_lm()
    traces = [at.build_trace(lm.tokenizer, _examples(3), max_doc_tokens=12) for _ in range(3)]
    for i, trace in enumerate(traces):
        trace["id"] = f"trace-{i}"
    monkeypatch.setattr(at.study, "build_traces", lambda tok, p, seed=0: [dict(t) for t in traces])  # the study's cases
    real, calls, stop = at.run_trace, [], ["trace-1"]

    def counting(lm_, trace, *args, **kwargs):
        calls.append(trace["id"])
        if stop and trace["id"] == stop[0]:
            stop.clear()
            raise _Stopped  # the first run is stopped in its second trace
        return real(lm_, trace, *args, **kwargs)

    monkeypatch.setattr(at.study, "run_trace", counting)  # the study's run
    kw = dict(preset="smoke", out=tmp_path, executor="sequential", budgets=[5], max_new_tokens=2, progress=False)
    with pytest.raises(_Stopped):
        at.STUDY.sweep(lm, **kw)
    assert not (tmp_path / at.TABLE_FILE).exists()
    assert [f.name.split("-")[:2] for f in (tmp_path / "parts").glob("*.jsonl")] == [["trace", "0"]]  # trace-0 kept
    assert [f.name for f in (tmp_path / "parts").iterdir() if f.name.endswith(".tmp")] == []
    runs, where, _ = at.STUDY.sweep(lm, **kw)
    assert calls == ["trace-0", "trace-1", "trace-1", "trace-2"]  # trace-0 read back, not rerun
    assert list(runs.trace.unique()) == ["trace-0", "trace-1", "trace-2"]
    pd.testing.assert_frame_equal(runs, pd.read_parquet(where / at.TABLE_FILE))
    fresh, *_ = at.STUDY.sweep(lm, **{**kw, "out": tmp_path / "fresh"})
    pd.testing.assert_frame_equal(runs.drop(columns=["sync_ms", "query_ms", "ttft_ms", "cum_ttft_ms"]),
                                  fresh.drop(columns=["sync_ms", "query_ms", "ttft_ms", "cum_ttft_ms"]))
    calls.clear()
    again, *_ = at.STUDY.sweep(lm, **kw)  # everything stored: nothing runs, the same table
    assert calls == []
    pd.testing.assert_frame_equal(again, runs)
    with pytest.raises(ValueError, match=f"out_dir='{tmp_path}'.*trace-0.*another params"):
        at.STUDY.sweep(lm, **{**kw, "max_new_tokens": 3})  # another fingerprint: refused, nothing recomputed
    assert calls == []


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
                kind = {0: "new", 1: "new", 2: "reask-removed"}[turn]
                rows.append({"trace": trace, "turn": turn, "path": path, "region": region, "kind": kind,
                             "known": True, "ttft_ms": ttft, "recomputed": rec, "agree": agree, "em": agree,
                             "tokens": 80})
    return at.add_cumulative(pd.DataFrame(rows))


def test_tables_and_conclusion_on_hand_made_runs():
    runs = _runs()
    last = runs[(runs.turn == 2) & (runs.path == "sync 5%")]
    assert (last.cum_recomputed == 80 + 5 + 10).all() and np.allclose(last.cost_ratio, 95 / 240)
    regions = at.region_table(runs).set_index(["region", "path"])
    first = regions.loc[("first half", "sync 5%")]
    assert first.speedup == pytest.approx(3.0) and first.agree_pct == 50.0 and first.agree_delta == -50.0
    assert math.isnan(first.speedup_lo)  # every ratio is 3: no interval, never a zero-width one
    assert first.losses == 1 and first.loss_upper_pct == pytest.approx(100 * 0.975**0.5, abs=1e-9)  # 1 of 2
    assert regions.loc[("append", "sync 5%")].speedup == pytest.approx(1.0)
    summary = at.summary_table(runs).set_index("path")
    assert summary.loc["sync 5%", "agree_pct"] == 75.0 and math.isclose(summary.loc["sync 5%", "cost_ratio"], 95 / 240)
    text = "\n".join(at.conclusion(at.region_table(runs), at.summary_table(runs), runs, n_boot=200))
    # Two traces decide nothing: a speed-up on both traces is not "faster" (no test on two clusters reaches 5 %),
    # and 0 losses in 2 appended turns bound the loss rate at 84 %, not 5 %.
    assert "primary (tested alone): 1 not separated" in text
    assert ("sync 5% (reaching questions) vs prefix reuse (reaching questions): not separated at this size, -50.0 pp "
            "(95 % CI -100.0 to +27.3; 2 turns, 1 discordant; Holm over 1 comparison") in text
    assert "sync 5% vs prefix reuse: not separated at this size (not shown faster), 1.73x" in text
    assert ("reask-removed questions (2 turns, gold known on 100 %): agreement with re-prefill sync 5% 50 %, prefix "
            "reuse 100 %; EM re-prefill 100 %, sync 5% 50 %.") in text
    kinds = at.kind_table(runs).set_index(["kind", "path"])
    assert list(dict.fromkeys(kinds.index.get_level_values("kind"))) == ["new", "reask-removed", "reaching", "all"]
    lost = kinds.loc[("reask-removed", "sync 5%")]
    assert lost.agree_pct == 50.0 and lost.losses == 1 and lost.known_pct == 100.0 and lost.agree_delta == -50.0
    assert kinds.loc[("new", "sync 5%")].agree_pct == 100.0 and kinds.loc[("all", "sync 5%")].turns == 4
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


def _decisive_runs(losing: int = 20) -> pd.DataFrame:
    """60 traces of two later turns: an append asking a new question, then a first-half change asking a re-ask of a
    compacted output, on which sync 5% loses re-prefill's answer in the first ``losing`` traces."""
    rows = []
    rng = np.random.default_rng(0)
    for t in range(60):
        for turn, region in ((1, "append"), (2, "first half")):
            for path in ("sync 5%", at.PREFIX, at.REFERENCE):
                ttft = {"sync 5%": 100.0, at.PREFIX: 300.0, at.REFERENCE: 400.0}[path] * rng.uniform(0.9, 1.1)
                if region == "append" and path != at.REFERENCE:
                    ttft = 50.0 * rng.uniform(0.9, 1.1)
                lost = path == "sync 5%" and region == "first half" and t < losing  # a third of the first-half turns
                rows.append({"trace": f"t{t}", "turn": turn, "path": path, "region": region,
                             "kind": "new" if region == "append" else "reask-compacted", "known": True,
                             "ttft_ms": ttft, "recomputed": 10, "agree": not lost, "em": not lost, "tokens": 80})
    return at.add_cumulative(pd.DataFrame(rows))


def test_the_conclusion_decides_with_enough_traces():
    runs = _decisive_runs(20)
    text = "\n".join(at.conclusion(at.region_table(runs), at.summary_table(runs), runs, n_boot=500))
    assert "sync 5% is faster than prefix reuse" in text  # the speed-up over every later turn
    assert "primary (tested alone): 1 beats" in text
    # 20 of 60 reaching turns lost, all in one direction
    assert "agreement on the reaching questions (Holm over 1 comparison): 1 loses to" in text
    assert "sync 5% (reaching questions) loses to prefix reuse (reaching questions): -33.3 pp" in text
    assert "first half: a loss of agreement above 5 points is shown" in text
    assert "Not shown at this size (faster, or within 5 points of agreement) in: append." in text


def test_agreement_is_equivalent_only_with_enough_reaching_turns():
    """No loss on 60 reaching turns puts the 90 % interval inside ±5 points (equivalent); one lost turn in 60 does
    not; the primary counts reaching questions only, never the new ones."""
    table = at.primary_table(_decisive_runs(0), n_boot=500).set_index("family")
    reaching = table.loc[at.AGREEMENT_FAMILY.name]
    assert reaching.verdict == "equivalent" and reaching.n == 60 and reaching.tost_high - reaching.tost_low < 0.1
    one_lost = at.primary_table(_decisive_runs(1), n_boot=500).set_index("family")
    assert one_lost.loc[at.AGREEMENT_FAMILY.name].verdict == "not separated"
    assert table.loc["primary"].verdict == one_lost.loc["primary"].verdict == "beats"  # faster, on every turn
    kinds = table.loc[at.KIND_FAMILY.name]
    assert list(kinds.a) == ["sync 5% (new)", "sync 5% (reask-compacted)"] and (kinds.n == 60).all()


def test_clustering_by_trace_widens_the_intervals():
    """Turns of a trace are not independent: when the losses and the speed-ups concentrate in a few traces the
    clustered intervals (the declared analysis) are wider than the turn-level ones; when each trace holds one turn,
    clustering changes nothing for the ratio (the same bootstrap draws) and the binary interval stays the hull."""
    rows = []
    rng = np.random.default_rng(1)
    for t in range(12):
        slow = 1.0 if t < 6 else 4.0  # half the traces gain little, half a lot
        for turn in range(1, 6):
            for path in ("sync 5%", at.PREFIX, at.REFERENCE):
                ttft = {"sync 5%": 100.0, at.PREFIX: 100.0 * slow * 1.2, at.REFERENCE: 500.0}[path]
                lost = path == "sync 5%" and t < 2  # every reaching turn of two traces lost
                rows.append({"trace": f"t{t}", "turn": turn, "path": path, "region": "first half",
                             "kind": "reask-removed", "known": True, "ttft_ms": ttft * rng.uniform(0.95, 1.05),
                             "recomputed": 10, "agree": not lost, "em": not lost, "tokens": 80})
    runs = at.add_cumulative(pd.DataFrame(rows))
    clustered = at.primary_table(runs, n_boot=2_000).set_index("family")
    flat = at.primary_table(runs, clustered=False, n_boot=2_000).set_index("family")
    for name in (at.AGREEMENT_FAMILY.name, "primary"):
        c, f = clustered.loc[name], flat.loc[name]
        assert c.estimate == pytest.approx(f.estimate) and c.n == f.n == 60
        assert c.n_clusters == 12 and f.n_clusters == 60
        assert c.ci_low < f.ci_low and c.ci_high > f.ci_high, name  # wider on both sides
    agree = at.AGREEMENT_FAMILY.name
    assert flat.loc[agree].p < 0.01 and clustered.loc[agree].p == pytest.approx(0.5)  # 10 vs 2 discordant units
    regions = at.region_table(runs, clustered=True).set_index(["region", "path"]).loc[("first half", "sync 5%")]
    flat_regions = at.region_table(runs, clustered=False).set_index(["region", "path"]).loc[("first half", "sync 5%")]
    assert regions.speedup_hi - regions.speedup_lo > flat_regions.speedup_hi - flat_regions.speedup_lo
    one = runs[runs.turn == 1]  # one turn per trace: clusters are the turns
    a = at.primary_table(one, n_boot=2_000).set_index("family").loc["primary"]
    b = at.primary_table(one, clustered=False, n_boot=2_000).set_index("family").loc["primary"]
    assert (a.ci_low, a.ci_high) == (b.ci_low, b.ci_high)


def test_traces_are_split_by_the_pools_capacity():
    """Evenly while every dev pool has room, the excess to the datasets with room, never a source twice; the paper
    preset (>= 48 traces of >= 8 turns, passages capped at 96 tokens) fits the shipped development pools."""
    assert at.split_traces(9, [16, 16, 48]) == [3, 3, 3]
    assert at.split_traces(48, [12, 12, 36]) == [12, 12, 24]
    assert at.split_traces(5, [1, 0, 9]) == [1, 0, 4]
    with pytest.raises(ValueError, match="n_traces"):
        at.split_traces(10, [3, 3, 3])
    paper, default = at.STUDY.params("paper"), at.STUDY.params("default")
    assert paper["n_traces"] >= 48 and paper["turns"] >= 8
    assert paper["max_doc_tokens"] == default["max_doc_tokens"] == 96
    try:
        pools = [[ex for ex in load_qa(ds, split="dev") if ex.distractors and ex.supporting]
                 for ds in paper["datasets"]]
    except FileNotFoundError as err:
        pytest.skip(str(err))
    split = at.split_traces(paper["n_traces"], [len(pool) // paper["turns"] for pool in pools])
    assert sum(split) == paper["n_traces"] and all(s * paper["turns"] <= len(p) for s, p in zip(split, pools))
