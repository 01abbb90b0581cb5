"""Agent turns: time to first answer token of ``EditSession.sync`` at b % against prefix reuse and full re-prefill.

An agent sends its whole prompt every turn. Per turn of each trace, four sessions follow the same prompts:

* ``sync``: :meth:`EditSession.sync` with SUR at ``--budget`` % and ``SyncPolicy(0, 1.0)`` (always repairs), refreshed
  with ``--executor`` (default ``packed``);
* ``sync (policy)``: the same with the default :class:`SyncPolicy` (falls back to prefix reuse when it says so);
* ``prefix reuse``: recompute every row from the first change (what serving engines do: ``SyncPolicy`` with an
  unreachable ``min_stale_rows``);
* ``re-prefill``: prefill the whole prompt every turn.

Time to first token (TTFT, ms) = the sync call (rendering, tokenization, diff, repair) + the forward of the next
query (its first logit, ``Answer.timings_ms["query"]``). Each turn's sync is timed ``--repeats`` times on forks of the
session (forks share tensors; the arms are interleaved within each repeat) and the median is kept. Reported per turn:
TTFT median per arm, tokens recomputed, path, where the first change is (fraction of the prompt), and whether the next
answer (greedy, ``--max-new-tokens``) is token for token re-prefill's, and for the repair turns the median time of
each stage of the sync (diff, prefill of inserted rows, shift, select, refresh, debt). Then medians side by side and ratios over all turns and
over the turns whose first change lies in the first half of the prompt.

Traces: ``--traces FILE`` (JSON: a list of ``{"id", "turns": [{"messages": [...], "question": str}, ...]}``; the
agent-trace study writes these), or by default a synthetic trace per QA example (``--dataset``, dev split): the task,
then one passage per turn as a tool output, with the edits agent runtimes make: old tool outputs compacted into one
line, a superseded output removed, the plan rewritten in the middle, a new turn appended.

Usage (timings to report: run alone, ``flock -x /work/cpu.lock``)::

    PYTHONPATH=$PWD python scripts/bench_sync.py [--model NAME] [--traces FILE] [--num-traces 3] [--turns 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import pandas as pd
import torch

from sur_lab import EditSession, SyncPolicy, chat_segments, load_model

PLAN = "Plan: read each tool output, keep what answers the task, drop what is superseded, then answer briefly."
REWRITTEN = "Plan (revised): the first outputs are summarised; look for the facts that link the titles, then answer."


def synthetic_traces(dataset: str, num_traces: int, turns: int) -> list[dict]:
    """One trace per QA example: task, plan, then a passage per turn with compaction, removal and a plan rewrite."""
    from sur_lab.studies.datasets import load_qa

    traces = []
    for ex in load_qa(dataset, split="dev", limit=num_traces):
        passages = [*ex.supporting, *ex.distractors]
        messages = [{"role": "system", "content": "You are a research agent. Answer in a few words."},
                    {"role": "user", "content": f"Task: {ex.question}"},
                    {"role": "assistant", "content": PLAN}]
        outputs = []  # indices into messages of full tool outputs, oldest first
        trace = []
        for t in range(turns):
            if t >= 2 and outputs:  # compact the oldest full output into one line
                i = outputs.pop(0)
                title = messages[i]["content"].split("\n", 1)[0]
                messages[i] = {"role": "tool", "content": f"{title} (summarised: read earlier)."}
            if t == 3:
                messages[2] = {"role": "assistant", "content": REWRITTEN}  # the plan rewritten in the middle
            if t == 4 and len(outputs) > 1:  # a superseded output removed
                i = outputs.pop(0)
                del messages[i]
                outputs = [j - 1 if j > i else j for j in outputs]
            p = passages[t % len(passages)]
            messages.append({"role": "tool", "content": f"Title: {p.title}\n{p.text.strip()}"})
            outputs.append(len(messages) - 1)
            trace.append({"messages": [dict(m) for m in messages], "question": ex.question})
        traces.append({"id": ex.id, "turns": trace})
    return traces


ARMS = {
    "sync": dict(method="SUR", sync_policy=SyncPolicy(0, 1.0)),
    "sync (policy)": dict(method="SUR", sync_policy=SyncPolicy()),
    "prefix reuse": dict(method="SUR", sync_policy=SyncPolicy(min_stale_rows=10**12)),
    "re-prefill": dict(method="Re-prefill"),
}


def run_trace(lm, trace: dict, budget: float, repeats: int, max_new_tokens: int, executor: str) -> list[dict]:
    tok = lm.tokenizer
    sessions = {name: EditSession(lm, budget_pct=budget, executor=executor, **kw) for name, kw in ARMS.items()}
    rows = []
    for t, turn in enumerate(trace["turns"]):
        messages = turn["messages"]
        query = "".join(chat_segments(tok, messages + [{"role": "user", "content": turn["question"]}],
                                      add_generation_prompt=True)[len(chat_segments(tok, messages)):])
        times: dict[str, list[float]] = {name: [] for name in ARMS}
        records = {}
        for _ in range(repeats):
            for name, session in sessions.items():
                fork = session.fork()
                t0 = time.perf_counter()
                records[name] = fork.sync(messages)
                times[name].append((time.perf_counter() - t0) * 1e3)
                records[name + "/session"] = fork
        answers = {}
        for name in ARMS:
            sessions[name] = records.pop(name + "/session")
            answers[name] = sessions[name].answer(query, max_new_tokens=max_new_tokens)
        for name in ARMS:
            rec = records[name]
            rows.append({
                "trace": trace["id"], "turn": t, "arm": name, "path": rec.path, "tokens": rec.num_tokens,
                "first_change_frac": rec.first_change / max(1, rec.num_tokens), "recomputed": rec.recomputed,
                "sync_ms": statistics.median(times[name]), "query_ms": answers[name].timings_ms["query"],
                "ttft_ms": statistics.median(times[name]) + answers[name].timings_ms["query"],
                "agree": answers[name].token_ids == answers["re-prefill"].token_ids,
                "debt": sessions[name].debt,
                **{f"{k}_ms": v for k, v in rec.timings_ms.items() if k != "total"},
            })
    return rows


def summarize(df: pd.DataFrame) -> str:
    lines = []
    sync0 = df[df.turn > 0]  # turn 0 is the first prefill in every arm
    for label, part in (("all turns after the first", sync0),
                        ("first change in the first half", sync0[sync0.first_change_frac < 0.5])):
        if part.empty:
            continue
        med = part.pivot_table(index=["trace", "turn"], columns="arm", values="ttft_ms")
        agree = part.groupby("arm")["agree"].mean() * 100
        rec = part.groupby("arm")["recomputed"].median()
        lines.append(f"\n{label} ({len(med)} turns): median TTFT ms, tokens recomputed (median), next answer "
                     "token-identical to re-prefill's (%)")
        for arm in ARMS:
            lines.append(f"  {arm:<14} {med[arm].median():9.1f} ms  {rec[arm]:7.0f} tok  {agree[arm]:5.1f} %")
        ratio_p = (med["prefix reuse"] / med["sync"]).median()
        ratio_r = (med["re-prefill"] / med["sync"]).median()
        ratio_pp = (med["prefix reuse"] / med["sync (policy)"]).median()
        lines.append(f"  paired per-turn median ratios: prefix reuse / sync = {ratio_p:.2f}x, re-prefill / sync = "
                     f"{ratio_r:.2f}x, prefix reuse / sync (policy) = {ratio_pp:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="load_model name (default: embedded SmolLM2)")
    parser.add_argument("--traces", default=None, help="JSON traces file (default: synthetic traces from QA)")
    parser.add_argument("--dataset", default="hotpotqa", help="QA dataset of the synthetic traces (dev split)")
    parser.add_argument("--num-traces", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--budget", type=float, default=5.0, help="sync budget b, %% of the stale rows")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs per turn and arm (median kept)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--executor", default="packed", help="executor of the sync arms' refresh")
    parser.add_argument("--out", default=None, help="write the per-turn table as CSV here")
    args = parser.parse_args()
    for name in ("num_traces", "turns", "repeats", "max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.budget <= 100:
        parser.error("--budget must be in [0, 100]")
    torch.set_num_threads(args.threads)
    if args.traces:
        with open(args.traces) as f:
            traces = json.load(f)
    else:
        traces = synthetic_traces(args.dataset, args.num_traces, args.turns)
    lm = load_model(args.model)
    print(f"model {lm.spec.name} ({lm.dtype}), {len(traces)} traces, budget {args.budget:g} %, executor "
          f"{args.executor}, {args.repeats} repeats, {args.threads} thread(s)")
    rows = []
    for trace in traces:
        rows += run_trace(lm, trace, args.budget, args.repeats, args.max_new_tokens, args.executor)
    df = pd.DataFrame(rows)
    table = df.pivot_table(index=["trace", "turn"], columns="arm", values=["ttft_ms", "recomputed"]).round(1)
    table.columns = [f"{value} {arm}" for value, arm in table.columns]
    paths = df[df.arm == "sync (policy)"].set_index(["trace", "turn"])[["path", "tokens", "first_change_frac"]]
    paths = paths.rename(columns={"path": "policy path"}).round(2)
    pd.set_option("display.width", 250)
    print(table.join(paths).to_string())
    print(summarize(df))
    stages = [c for c in df.columns if c.endswith("_ms") and c not in ("sync_ms", "query_ms", "ttft_ms")]
    repaired = df[df.path == "repair"]
    if not repaired.empty:
        print("\nrepair turns, median stage times of the last timed sync (ms):")
        print(repaired.groupby("arm")[stages].median().round(1).to_string())
    if args.out:
        from sur_lab.paths import atomic_path

        with atomic_path(args.out) as tmp:
            df.to_csv(tmp, index=False)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
