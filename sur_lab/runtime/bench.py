"""Packed-refresh benchmark (section 4.4, appendix 13.3): the Table 18 analogue, packed vs Replay, and the targets.

``sur-lab bench`` (``scripts/bench_packed_refresh.py`` calls its :func:`main`); the measurements are
:mod:`sur_lab.studies.bench`'s, as in notebooks/04_packed_refresh_benchmark.ipynb. N is the edited context (the Shift
cache's rows: a 16-token prefix and the suffix); its Dirty prefill also holds the 8 deleted tokens, N + 8 in all, which
must fit the model's max_position_embeddings (8192 for SmolLM2; a larger N is refused before any prefill).
Defaults follow the issues: the embedded model, N in {2040, 8184} (original contexts of 2048 and 8192 tokens), B = 64,
R in {1, 4, 16}, executors sequential, direct-sequential, one-shot, packed-sdpa, packed-sdpa-split, packed-flex,
packed-cpp (the one-pass C++ kernel; built on first use), the in-place forms packed-inplace and
direct-sequential-inplace (a fresh copy of the Shift cache per call, untimed) and the arithmetic floor append-forward
(packed-triton added and timed on CUDA only), 10 warm-ups then 20 interleaved repetitions, medians; then packed
executors against two Replays for budgets 1-20 % of the suffix at N = 8184: transformers' Replay and each executor at
a 100 % support (the same attention path), beside the floors B/S (Eq. 15) and the causal-pair fraction and bound
(Eq. 18) (fewer repetitions: one Replay of 8K tokens takes about a minute on one core); then serial vs overlapped
recovery (appendix 13.3) on a 2,412-token natural-text edit; then one layer's attention alone at the model's heads
(one-pass kernel, key split, and the unmasked call over the same row-key pairs, their floor); then the targets of
issues 17 and 30, each with met / NOT met.

    .venv/bin/sur-lab bench --threads 1         # full default grid (about 40 min, 2 cores)
    .venv/bin/sur-lab bench --context-lens 1024 --warmups 1 --repeats 3 --budgets 5

Wall times come from time.perf_counter (CUDA synchronized). Run on a quiet machine: timings are medians, not bounds.
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
import torch
from tqdm.auto import tqdm

from sur_lab import models
from sur_lab.analysis.plotting import run_tag, save_table
from sur_lab.executors import get_executor
from sur_lab.runtime.params import budget_arg, int_arg
from sur_lab.studies import bench
from sur_lab.studies.bench import DELETED_LEN, PREFIX_LEN

#: Smallest natural-text edit of the overlap comparison (``sur_lab.studies.bench.text_edit``).
MIN_OVERLAP_TOKENS = 64
DTYPES = ("float32", "bfloat16", "float16", "float64")


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (``--help``); every range is checked while parsing (:func:`parse_args`)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0]
        + f" N is the edited context (the Shift cache's rows, prefix {PREFIX_LEN} + suffix); the Dirty prefill has "
        f"N + {DELETED_LEN} tokens (the deleted span), which must not exceed the model's max_position_embeddings "
        f"(8192 for SmolLM2: N <= {8192 - DELETED_LEN}); larger N is refused before any prefill."
    )
    min_n = PREFIX_LEN + 1
    parser.add_argument("--model", default=None, help="hub id or path; default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=DTYPES, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--context-lens", type=int_arg("--context-lens", min_n), nargs="+",
                        default=[2048 - DELETED_LEN, 8192 - DELETED_LEN],
                        help=f"N, tokens of the edited context (>= {min_n}); default 2040 and 8184, so that the "
                             f"original context N + {DELETED_LEN} is 2048 / 8192 tokens (the 2K / 8K rows of "
                             "Table 18)")
    parser.add_argument("--num-selected", type=int_arg("--num-selected", 1), default=64,
                        help="B, positions (a multiple of every --intervals value, placed inside the suffix of every N)")
    parser.add_argument("--intervals", type=int_arg("--intervals", 1), nargs="+", default=[1, 4, 16],
                        help="R values (each divides B)")
    parser.add_argument(
        "--executors",
        nargs="+",
        default=["sequential", "direct-sequential", "one-shot", "packed-sdpa", "packed-sdpa-split", "packed-flex",
                 "packed-cpp", "packed-triton", "packed-inplace", "direct-sequential-inplace", "append-forward"],
        help="registered executor names (packed-triton* are skipped off CUDA; *-inplace get an untimed fresh copy "
             "per call; append-forward is the plain-forward floor)",
    )
    parser.add_argument("--warmups", type=int_arg("--warmups", 0), default=10, help="untimed rounds (>= 0)")
    parser.add_argument("--repeats", type=int_arg("--repeats", 1), default=20, help="timed rounds (>= 1)")
    parser.add_argument("--budgets", type=budget_arg("--budgets"), nargs="*", default=[1, 2, 5, 10, 20],
                        help="Replay sweep budgets, %% of the suffix, in (0, 100] (none: skip the sweep)")
    parser.add_argument("--replay-context-len", type=int_arg("--replay-context-len", min_n),
                        default=8192 - DELETED_LEN,
                        help=f"N of the Replay sweep, edited-context tokens (>= {min_n}; default 8184: an original "
                             f"context of 8192)")
    parser.add_argument("--sweep-intervals", type=int_arg("--sweep-intervals", 1), default=16,
                        help="R of the sweep's supports (>= 1)")
    parser.add_argument("--sweep-executors", nargs="+", default=["packed-sdpa-split", "packed-inplace"],
                        help="packed executors timed beside Replay (each also at a 100 %% support unless "
                             "--no-full-support; packed-sdpa there would build a [S, S] mask)")
    parser.add_argument("--no-full-support", dest="full_support", action="store_false",
                        help="skip the packed executors' 100 %% supports (the same-path Replay baseline)")
    parser.add_argument("--replay-warmups", type=int_arg("--replay-warmups", 0), default=1)
    parser.add_argument("--replay-repeats", type=int_arg("--replay-repeats", 1), default=5)
    parser.add_argument("--overlap-context-len", type=int_arg("--overlap-context-len", MIN_OVERLAP_TOKENS,
                                                                       zero=True), default=2412,
                        help=f"tokens of the natural-text edit of the overlap comparison (0: skip it; else >= "
                             f"{MIN_OVERLAP_TOKENS})")
    parser.add_argument("--overlap-budget", type=budget_arg("--overlap-budget"), default=5.0,
                        help="b of the overlap comparison, %% in (0, 100]")
    parser.add_argument("--overlap-executor", default="packed",
                        help="executor of the overlap comparison (its in-place form is used)")
    parser.add_argument("--overlap-warmups", type=int_arg("--overlap-warmups", 0), default=10)
    parser.add_argument("--overlap-repeats", type=int_arg("--overlap-repeats", 1), default=20)
    parser.add_argument("--attention-repeats", type=int_arg("--attention-repeats", 1, zero=True), default=15,
                        help="interleaved rounds of the attention-only timing at the model's heads and the largest "
                             "N (0: skip it)")
    parser.add_argument("--attention-backends", nargs="+", default=["split", "onepass", "unmasked"],
                        choices=["sdpa-gqa", "split", "onepass", "flex", "unmasked"],
                        help="paths of the attention-only timing (sur_lab.studies.bench.attention_only)")
    parser.add_argument("--target-executor", default="packed-inplace",
                        help="the packed executor whose ratios the targets are about")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int_arg("--threads", 0), default=0,
                        help="torch CPU threads (0: torch's default)")
    parser.add_argument("--save", action="store_true", help="also write the tables to outputs/tables")
    return parser


def check_args(args: argparse.Namespace) -> str | None:
    """The first cross-argument problem that can be decided without the model, as a message naming the arguments,
    or ``None``: every (N, R) of the grid must admit a matched support of B positions inside the suffix
    (``sur_lab.studies.bench.matched_support``), and every executor name must be registered (in-place form for
    ``--overlap-executor``)."""
    for n in args.context_lens:
        suffix = n - PREFIX_LEN
        if args.num_selected > suffix:
            return (f"--num-selected {args.num_selected} exceeds the suffix of --context-lens {n} "
                    f"({n} - prefix {PREFIX_LEN} = {suffix} positions); use B <= {suffix} or N >= "
                    f"{args.num_selected + PREFIX_LEN}")
    for r in args.intervals:
        if args.num_selected % r:
            return (f"--num-selected {args.num_selected} must be a multiple of every --intervals value; "
                    f"{r} does not divide it")
    for n in args.context_lens:
        for r in args.intervals:
            try:
                bench.matched_support(n, PREFIX_LEN, args.num_selected, r)
            except ValueError as err:
                return f"--context-lens {n} with --num-selected {args.num_selected}, --intervals {r}: {err}"
    names = [("--executors", e) for e in args.executors if e != bench.APPEND_FORWARD]
    names += [("--sweep-executors", e) for e in args.sweep_executors] + [("--target-executor", args.target_executor)]
    for option, name in names:
        try:
            get_executor(name)
        except ValueError as err:
            return f"{option}: {err}"
    try:
        get_executor(args.overlap_executor, inplace=True)
    except ValueError as err:
        return f"--overlap-executor: {err}"
    return None


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check ``argv`` before any work: a bad value exits with code 2 and a message naming the argument."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem:
        parser.error(problem)
    return args


def check_model_limit(args: argparse.Namespace, max_positions: int | None) -> str | None:
    """A message naming the argument whose context exceeds the model's ``max_position_embeddings`` (the Dirty prefill
    of N + :data:`DELETED_LEN` tokens; the overlap edit's own length), or ``None``; ``max_positions`` ``None``: no
    limit known."""
    if not max_positions:
        return None
    top = max_positions - DELETED_LEN
    for option, lengths in (("--context-lens", args.context_lens),
                            ("--replay-context-len", [args.replay_context_len] if args.budgets else [])):
        for n in lengths:
            if n > top:
                return (f"{option} {n}: the Dirty prefill has N + {DELETED_LEN} = {n + DELETED_LEN} tokens, beyond the "
                        f"model's max_position_embeddings={max_positions}; use N <= {top}")
    return None


def main(argv=None) -> int:
    """Run the benchmark with command-line ``argv`` (``None``: ``sys.argv[1:]``) and print its tables; returns the exit
    code 0 (a bad argument exits with 2 and a message naming it, before the model loads)."""
    args = parse_args(argv)

    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    # through the module: tests replace sur_lab.models.load_model
    lm = models.load_model(args.model, dtype=getattr(torch, dtype), device=args.device)
    print(f"model {lm.spec.name} ({lm.spec.num_layers} layers, {lm.spec.num_heads}/{lm.spec.num_kv_heads} heads, "
          f"d_h {lm.spec.head_dim}), {dtype} on {args.device}, torch threads {torch.get_num_threads()}")
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    problem = check_model_limit(args, limit)
    overlap_edit = None
    if args.overlap_context_len and not problem:  # tokenization only: checked before any prefill
        overlap_edit = bench.text_edit(lm, args.overlap_context_len, seed=args.seed)
        if limit and overlap_edit.num_tokens > limit:
            problem = (f"--overlap-context-len {args.overlap_context_len}: the natural-text edit has "
                       f"{overlap_edit.num_tokens} tokens before the deletion, beyond the model's "
                       f"max_position_embeddings={limit}")
    if problem:
        build_parser().error(problem)
    timed, skipped = bench.timed_executors(args.executors, lm.device)
    if skipped:
        print(f"not timed on {args.device}: {', '.join(skipped)} (Triton is timed on CUDA only)")

    lengths = sorted(set(args.context_lens) | ({args.replay_context_len} if args.budgets else set()))
    contexts = {}
    for n in lengths:
        t0 = time.perf_counter()
        contexts[n] = bench.prepare_context(lm, n, seed=args.seed)
        print(f"prepared N={n}: Dirty prefill + Shift {time.perf_counter() - t0:.1f} s")

    timings, checks = bench.refresh_grid(
        lm,
        [contexts[n] for n in args.context_lens],
        num_selected=args.num_selected,
        num_intervals=args.intervals,
        executors=timed,
        warmups=args.warmups,
        repeats=args.repeats,
        seed=args.seed,
        progress=lambda it: tqdm(it, desc="grid rounds", leave=False),
    )
    medians = bench.grid_medians(timings)
    compiles = " (first call includes flex compilation)" if any(e == "packed-flex" for e in timed) else ""
    print(f"\nChecks against the sequential executor{compiles}:")
    print(checks.to_string(index=False, float_format="{:.3g}".format))
    print(f"\nTable 18 analogue: median refresh ms, B = {args.num_selected}, "
          f"{args.warmups} warm-ups + {args.repeats} interleaved repetitions")
    print(bench.table18(medians, timed).to_string(index=False, float_format="{:.1f}".format))

    replay = None
    if args.budgets:
        sweep = bench.replay_sweep(
            lm,
            contexts[args.replay_context_len],
            budgets=args.budgets,
            num_intervals=args.sweep_intervals,
            executors=args.sweep_executors,
            full_support=args.full_support,
            warmups=args.replay_warmups,
            repeats=args.replay_repeats,
            seed=args.seed,
            progress=lambda it: tqdm(it, desc="replay rounds", leave=False),
        )
        replay = bench.replay_medians(sweep)
        print(f"\nPacked vs Replay, N={args.replay_context_len}, R<={args.sweep_intervals}, "
              f"{args.replay_warmups} warm-up(s) + {args.replay_repeats} repetitions. fraction_of_replay: over "
              "transformers' Replay; fraction_of_packed_replay: over the same executor at a 100 % support; floors: "
              "token_fraction B/S (Eq. 15), pair_fraction and pair_bound min(1, 2B/S) (Eq. 18); over_token_floor = "
              "fraction_of_packed_replay / token_fraction:")
        print(replay.to_string(index=False, float_format="{:.4f}".format))

    overlap = None
    if overlap_edit is not None:
        edit = overlap_edit
        _, overlap = bench.overlap_recovery(
            lm, edit, budget_pct=args.overlap_budget, executor=args.overlap_executor,
            warmups=args.overlap_warmups, repeats=args.overlap_repeats, seed=args.seed,
            progress=lambda it: tqdm(it, desc="overlap rounds", leave=False),
        )
        print(f"\nRecovery from Dirty (Shift + SUR + in-place {args.overlap_executor}), serial vs overlapped "
              f"(appendix 13.3), natural text N={edit.edited_len}, b={args.overlap_budget:g} %, "
              f"{args.overlap_warmups} warm-ups + {args.overlap_repeats} interleaved repetitions, median ms:")
        print(overlap.to_string(index=False, float_format="{:.2f}".format))

    context_len = max(args.context_lens)
    attention = None
    if args.attention_repeats:
        frames = []
        for r in args.intervals:
            frames.append(bench.attention_only(
                context_len, r, num_selected=args.num_selected, num_heads=lm.spec.num_heads,
                num_kv_heads=lm.spec.num_kv_heads, head_dim=lm.spec.head_dim, dtype=lm.dtype, device=lm.device,
                backends=args.attention_backends, warmups=3, repeats=args.attention_repeats, seed=args.seed))
        attention = pd.concat(frames, ignore_index=True)
        print(f"\nOne layer's attention alone, N={context_len}, B={args.num_selected}, heads "
              f"{lm.spec.num_heads}/{lm.spec.num_kv_heads}, d_h {lm.spec.head_dim} (median us of "
              f"{args.attention_repeats} interleaved rounds; unmasked: one call over the same row-key pairs):")
        print(attention.to_string(index=False, float_format="{:.3g}".format))
    ratios = pd.concat(
        [bench.target_ratios(medians, replay, context_len=context_len, packed=p, overlap=overlap,
                             attention=attention).assign(packed=p)
         for p in timed if p.startswith("packed")],
        ignore_index=True,
    )
    print(f"\nTarget ratios (grid ratios at N={context_len}, the 5 % ratios at N={args.replay_context_len}; "
          "measured, not asserted):")
    print(ratios.to_string(index=False, float_format="{:.3f}".format))
    focus = ratios[ratios.packed == args.target_executor]
    if len(focus):
        print(f"\nTargets of issues 17 and 30 for {args.target_executor} (attention alone: the one-pass kernel):")
        for row in focus.itertuples():
            verdict = {True: "met", False: "NOT met", None: ""}[row.met]
            print(f"  {row.ratio:32s} {row.value:8.4f}   target {row.target:9s} {verdict} {row.note}")

    if args.save:
        tag = run_tag(model=lm.spec.name, device=args.device, B=args.num_selected, N=args.context_lens)
        save_table(timings, "bench_packed_timings", tag=tag)
        save_table(medians, "bench_packed_medians", tag=tag)
        save_table(ratios, "bench_packed_targets", tag=tag)
        if overlap is not None:
            save_table(overlap, "bench_packed_overlap", tag=tag)
        if replay is not None:
            save_table(replay, "bench_packed_replay", tag=tag)
        if attention is not None:
            save_table(attention, "bench_packed_attention", tag=tag)
    return 0

