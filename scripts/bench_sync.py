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
TTFT median per arm, tokens recomputed, path, where the first change is (fraction of the cached prompt), and whether the next
answer (greedy, ``--max-new-tokens``) is token for token re-prefill's, and for the repair turns the median time of
each stage of the sync (diff, prefill of inserted rows, shift, select, refresh, debt). Then medians side by side and
paired ratios over all turns after the first and per region of the first change: the first or second half of the
cached prompt (the previous turn's), or a pure append.

Traces: the agent-trace study's (:mod:`sur_lab.studies.agent_traces`, notebook 10) at ``--preset`` (default
``default``: the QA development files, compaction, removal, a plan rewrite and appends), optionally fewer
(``--num-traces``, ``--turns``: a prefix of the preset's seeded selection); or ``--traces FILE`` (JSON: a list of
``{"id", "turns": [{"messages": [...], "question": str}, ...]}``, the study's ``traces.json``).

Choosing :class:`SyncPolicy`: from the always-repairing ``sync`` arm and the ``prefix reuse`` arm measured on the same
turns, every policy of a small grid (``min_stale_rows`` x ``max_new_share``) is replayed offline (a turn the policy
would repair takes sync's TTFT and answer, a turn it would fall back on takes prefix reuse's) and the table prints
each policy's median TTFT and agreement; the documented default is the fastest policy whose agreement is within
``--max-loss`` points of prefix reuse's (docs/sessions.md).

Usage (timings to report: run alone, ``flock -x /work/cpu.lock``)::

    PYTHONPATH=$PWD python scripts/bench_sync.py [--model NAME] [--preset default] [--num-traces N] [--turns T]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import pandas as pd
import torch

from sur_lab import EditSession, SyncPolicy, load_model
from sur_lab.edits import chat_segments

ARMS = {
    "sync": dict(method="SUR", sync_policy=SyncPolicy(0, 1.0)),
    "sync (policy)": dict(method="SUR", sync_policy=SyncPolicy()),
    "prefix reuse": dict(method="SUR", sync_policy=SyncPolicy(min_stale_rows=10**12)),
    "re-prefill": dict(method="Re-prefill"),
}


def run_trace(lm, trace: dict, budget: float, repeats: int, max_new_tokens: int, executor: str) -> list[dict]:
    from sur_lab.studies.agent_traces import query_text

    sessions = {name: EditSession(lm, budget_pct=budget, executor=executor, **kw) for name, kw in ARMS.items()}
    rows = []
    for t, turn in enumerate(trace["turns"]):
        messages = turn["messages"]
        query = query_text(lm.tokenizer, messages, turn["question"])
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
            after = rec.num_tokens - rec.first_change
            region = ("prefill" if t == 0 else "append" if rec.stale_rows == 0
                      else "first half" if rec.first_change < rec.previous_tokens / 2 else "second half")
            rows.append({
                "trace": trace["id"], "turn": t, "arm": name, "path": rec.path, "tokens": rec.num_tokens,
                "first_change_frac": rec.first_change / max(1, rec.previous_tokens), "region": region,
                "stale_rows": rec.stale_rows, "new_share": rec.inserted / after if after else 0.0,
                "recomputed": rec.recomputed,
                "sync_ms": statistics.median(times[name]), "query_ms": answers[name].timings_ms["query"],
                "ttft_ms": statistics.median(times[name]) + answers[name].timings_ms["query"],
                "agree": answers[name].token_ids == answers["re-prefill"].token_ids,
                "debt": sessions[name].debt,
                **{f"{k}_ms": v for k, v in rec.timings_ms.items() if k != "total"},
            })
    return rows


def summarize(df: pd.DataFrame) -> str:
    """Median TTFT, tokens recomputed and agreement per arm, for all turns after the first and per region of the
    first change, with paired per-turn median ratios."""
    lines = []
    later = df[df.turn > 0]  # turn 0 is the first prefill in every arm
    parts = [("all turns after the first", later)] + [
        (f"first change: {region}", later[later.region == region]) for region in ("first half", "second half", "append")]
    for label, part in parts:
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


#: The policy grid replayed by :func:`policy_grid`.
MIN_STALE = (0, 16, 32, 64, 128, 256)
MAX_NEW = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def policy_grid(df: pd.DataFrame) -> pd.DataFrame:
    """Every :class:`SyncPolicy` of the grid replayed on the measured turns after the first: a turn the policy would
    repair takes the always-repairing ``sync`` arm's TTFT and agreement, one it falls back on takes ``prefix reuse``'s
    (appends take the tail path under every policy). Columns: min_stale_rows, max_new_share, repaired (turns), median
    and mean TTFT (ms), agreement (%)."""
    later = df[df.turn > 0]
    wide = later.pivot_table(index=["trace", "turn"], columns="arm", values=["ttft_ms", "agree"], aggfunc="first")
    feats = later[later.arm == "sync"].set_index(["trace", "turn"])[["stale_rows", "new_share"]].loc[wide.index]
    rows = []
    for m in MIN_STALE:
        for share in MAX_NEW:
            repair = ((feats.stale_rows > 0) & (feats.stale_rows >= m) & (feats.new_share <= share)).to_numpy()
            ttft = wide["ttft_ms"]["sync"].where(repair, wide["ttft_ms"]["prefix reuse"])
            agree = wide["agree"]["sync"].where(repair, wide["agree"]["prefix reuse"]).astype(float)
            rows.append({"min_stale_rows": m, "max_new_share": share, "repaired": int(repair.sum()),
                         "ttft_median_ms": ttft.median(), "ttft_mean_ms": ttft.mean(), "agree_pct": 100 * agree.mean()})
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="load_model name (default: the preset's model)")
    parser.add_argument("--traces", default=None, help="JSON traces file (default: the agent-trace study's traces)")
    parser.add_argument("--preset", default="default", help="agent-trace study preset of the traces")
    parser.add_argument("--num-traces", type=int, default=None, help="traces (default: the preset's)")
    parser.add_argument("--turns", type=int, default=None, help="turns per trace (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0, help="source selection of the traces")
    parser.add_argument("--budget", type=float, default=5.0, help="sync budget b, %% of the stale rows")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs per turn and arm (median kept)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--executor", default="packed", help="executor of the sync arms' refresh")
    parser.add_argument("--max-loss", type=float, default=5.0,
                        help="policy choice: agreement points a policy may lose against prefix reuse")
    parser.add_argument("--out", default=None, help="write the per-turn table as CSV here")
    args = parser.parse_args()
    for name in ("num_traces", "turns", "repeats", "max_new_tokens", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.budget <= 100:
        parser.error("--budget must be in [0, 100]")
    torch.set_num_threads(args.threads)
    from sur_lab.studies import agent_traces
    from sur_lab.studies.presets import preset_model

    model = args.model if args.model is not None else preset_model(args.preset)
    lm = load_model(model)
    if args.traces:
        with open(args.traces) as f:
            traces = json.load(f)
    else:
        p = agent_traces.STUDY.params(args.preset)
        traces = agent_traces.build_traces(lm.tokenizer, p, seed=args.seed)
        if args.num_traces is not None:  # alternate datasets, as the study splits them
            by_ds = [[t for t in traces if t["id"].startswith(ds + ":")] for ds in p["datasets"]]
            traces = [t for group in zip(*by_ds) for t in group][: args.num_traces]
    if args.turns is not None:
        traces = [{**t, "turns": t["turns"][: args.turns]} for t in traces]
    print(f"model {lm.spec.name} ({lm.dtype}), {len(traces)} traces ({args.preset} preset), budget {args.budget:g} %, "
          f"executor {args.executor}, {args.repeats} repeats, {args.threads} thread(s)")
    rows = []
    for trace in traces:
        rows += run_trace(lm, trace, args.budget, args.repeats, args.max_new_tokens, args.executor)
    df = pd.DataFrame(rows)
    table = df.pivot_table(index=["trace", "turn"], columns="arm", values=["ttft_ms", "recomputed"]).round(1)
    table.columns = [f"{value} {arm}" for value, arm in table.columns]
    paths = df[df.arm == "sync (policy)"].set_index(["trace", "turn"])[
        ["path", "tokens", "first_change_frac", "stale_rows", "new_share"]]
    paths = paths.rename(columns={"path": "policy path"}).round(2)
    pd.set_option("display.width", 250)
    print(table.join(paths).to_string())
    print(summarize(df))
    stages = [c for c in df.columns if c.endswith("_ms") and c not in ("sync_ms", "query_ms", "ttft_ms")]
    repaired = df[df.path == "repair"]
    if not repaired.empty:
        print("\nrepair turns, median stage times of the last timed sync (ms):")
        print(repaired.groupby("arm")[stages].median().round(1).to_string())
    grid = policy_grid(df)
    prefix_agree = 100 * df[(df.turn > 0) & (df.arm == "prefix reuse")]["agree"].mean()
    ok = grid[grid.agree_pct >= prefix_agree - args.max_loss]
    print(f"\npolicy grid replayed on the measured turns (prefix reuse agreement {prefix_agree:.1f} %):")
    print(grid.round(1).to_string(index=False))
    if not ok.empty:
        best = ok.sort_values(["ttft_median_ms", "ttft_mean_ms", "min_stale_rows"]).iloc[0]
        print(f"fastest policy within {args.max_loss:g} points of prefix reuse's agreement: "
              f"SyncPolicy(min_stale_rows={int(best.min_stale_rows)}, max_new_share={best.max_new_share:g}) "
              f"({best.ttft_median_ms:.1f} ms median TTFT, {best.agree_pct:.1f} % agreement, "
              f"{int(best.repaired)} turns repaired)")
    else:
        top = grid[grid.agree_pct == grid.agree_pct.max()]
        print(f"no policy within {args.max_loss:g} points of prefix reuse's agreement; the most faithful "
              f"({top.agree_pct.iloc[0]:.1f} %): " + ", ".join(
                  f"SyncPolicy({int(r.min_stale_rows)}, {r.max_new_share:g})" for r in top.itertuples()))
    if args.out:
        from sur_lab.paths import atomic_path

        with atomic_path(args.out) as tmp:
            df.to_csv(tmp, index=False)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
