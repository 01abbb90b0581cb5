"""Benchmark plumbing (sur_lab.studies.bench) and numerical-validation helpers (sur_lab.studies.validation); no timing is asserted.

Supports are checked for the paper's matched causal pair counts (65,568 at 2K and 262,176 at 8K for B = 64); the
timing loop for its call pattern; the ratio tables on hand-made medians; the validation helpers on tiny models where
the expected value is exact (identical caches, identical executors, the kernel's FP64 oracle tolerances).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see test_kernels.py)

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from conftest import make_tiny_model  # noqa: E402

from sur_lab import load_model  # noqa: E402,F401
from sur_lab.studies import bench, validation  # noqa: E402
from sur_lab.budget import Support  # noqa: E402
from sur_lab.cache_ops import caches_equal, clone_cache  # noqa: E402
from sur_lab.executors import dirty, shift  # noqa: E402
from sur_lab.executors.packed import causal_pair_count  # noqa: E402


@pytest.mark.parametrize(("n", "pairs"), [(2048, 65_568), (8192, 262_176)])
def test_matched_supports_have_the_papers_pair_counts(n, pairs):
    for r in (1, 4, 16):
        support = bench.matched_support(n, 16, 64, r)
        absolute = support.absolute(16)
        assert support.size == 64 and support.num_intervals == r and support.suffix_len == n - 16
        assert absolute.min() >= 16 and absolute.max() < n
        assert causal_pair_count(absolute) == pairs
        # Mirror symmetry about (N - 1) / 2 is what makes M(U) independent of R.
        assert np.array_equal(np.sort(n - 1 - absolute), absolute)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(num_selected=64, num_intervals=3), "multiple"),
    (dict(num_selected=64, num_intervals=4, spread=0.0), "spread"),
    (dict(num_selected=64, num_intervals=64, context_len=100), "symmetric"),
])
def test_matched_support_rejects_impossible_requests(kwargs, match):
    args = dict(context_len=2048, prefix_len=16) | kwargs
    with pytest.raises(ValueError, match=match):
        bench.matched_support(**args)


def test_spread_support():
    s = bench.spread_support(1000, 50, 16)
    assert s.size == 50 and s.num_intervals == 16 and s.suffix_len == 1000
    assert bench.spread_support(1000, 5, 16).num_intervals == 5
    assert bench.spread_support(1000, 0, 16).size == 0
    with pytest.raises(ValueError, match="num_selected"):
        bench.spread_support(10, 11, 2)


def test_time_interleaved_calls_every_task_once_per_round():
    calls = []
    tasks = {("a",): lambda: calls.append("a"), ("b",): lambda: calls.append("b"), ("c",): lambda: calls.append("c")}
    df = bench.time_interleaved(tasks, warmups=2, repeats=4, seed=1)
    assert len(calls) == 3 * 6 and sorted(set(calls)) == ["a", "b", "c"]
    assert len(df) == 12 and (df["ms"] >= 0).all()
    for _, block in df.groupby("rep"):
        assert sorted(k[0] for k in block["key"]) == ["a", "b", "c"]
        assert sorted(block["order"]) == [0, 1, 2]
    orders = [tuple(calls[i : i + 3]) for i in range(0, len(calls), 3)]
    assert len(set(orders)) > 1  # the order is shuffled between rounds
    with pytest.raises(ValueError, match="repeats"):
        bench.time_interleaved(tasks, warmups=0, repeats=0)


def test_time_interleaved_setup_runs_before_each_call():
    made, seen = [], []

    def setup():
        made.append(len(made))
        return made[-1]

    df = bench.time_interleaved({("a",): (setup, seen.append)}, warmups=1, repeats=3)
    assert seen == made == [0, 1, 2, 3] and len(df) == 3


def test_ratio_tables_from_hand_made_medians():
    rows = [{"context_len": 8192, "num_intervals": 1, "executor": bench.APPEND_FORWARD, "ms": 7.0}]
    for r, seq, pk in ((1, 10.0, 8.0), (16, 160.0, 10.0)):
        rows += [{"context_len": 8192, "num_intervals": r, "executor": "sequential", "ms": seq},
                 {"context_len": 8192, "num_intervals": r, "executor": "packed-sdpa", "ms": pk}]
    medians = bench.grid_medians(pd.DataFrame(rows))
    table = bench.table18(medians, ["sequential", "packed-sdpa"])
    assert list(table.columns) == ["context_len", "num_intervals", "sequential", "packed-sdpa"]
    # Replay pairs: S P + S (S + 1) / 2 with P = 16, S = 8176; the 5 % support's pairs are made up (Eq. 18's numerator).
    replay_pairs = 8176 * 16 + 8176 * 8177 // 2
    sweep = pd.DataFrame([
        {"context_len": 8192, "method": "Replay", "budget_pct": 100.0, "num_selected": 8176, "num_intervals": 1,
         "pairs": replay_pairs, "rep": 0, "ms": 200.0},
        {"context_len": 8192, "method": "packed-sdpa", "budget_pct": 5.0, "num_selected": 409, "num_intervals": 16,
         "pairs": 1_700_000, "rep": 0, "ms": 20.0},
        {"context_len": 8192, "method": "packed-sdpa", "budget_pct": 100.0, "num_selected": 8176, "num_intervals": 1,
         "pairs": replay_pairs, "rep": 0, "ms": 125.0},
    ])
    replay = bench.replay_medians(sweep)
    packed_row = replay[(replay.method == "packed-sdpa") & (replay.budget_pct == 5.0)].iloc[0]
    assert packed_row.fraction_of_replay == pytest.approx(0.1)
    assert packed_row.fraction_of_packed_replay == pytest.approx(20.0 / 125.0)
    assert packed_row.token_fraction == pytest.approx(409 / 8176)
    assert packed_row.pair_fraction == pytest.approx(1_700_000 / replay_pairs)
    assert packed_row.pair_bound == pytest.approx(2 * 409 / 8176)
    assert packed_row.over_token_floor == pytest.approx(0.16 / (409 / 8176))
    assert np.isnan(replay[replay.method == "Replay"].fraction_of_packed_replay.iloc[0])
    overlap = pd.DataFrame({"mode": ["serial", "overlap"], "median_ms": [50.0, 45.0]})
    attention = pd.DataFrame({"backend": ["onepass", "unmasked", "onepass"], "num_intervals": [16, 16, 1],
                              "median_us": [6300.0, 6000.0, 5000.0]})
    targets = bench.target_ratios(medians, replay, packed="packed-sdpa", overlap=overlap,
                                  attention=attention).set_index("ratio")
    assert list(targets.index) == list(bench.TARGETS)
    assert targets.loc["packed_R16_over_R1", "value"] == pytest.approx(1.25)
    assert targets.loc["sequential_over_packed_R16", "value"] == pytest.approx(16.0)
    assert targets.loc["packed_R1_over_append_forward", "value"] == pytest.approx(8.0 / 7.0)
    assert targets.loc["packed_5pct_over_replay", "value"] == pytest.approx(0.1)
    assert targets.loc["packed_5pct_over_packed_replay", "value"] == pytest.approx(0.16)
    assert targets.loc["packed_5pct_over_token_floor", "value"] == pytest.approx(0.16 * 8176 / 409)
    assert targets.loc["attention_R16_over_unmasked", "value"] == pytest.approx(1.05)
    assert targets.loc["overlap_over_serial_recovery", "value"] == pytest.approx(0.9)
    assert targets["met"].tolist() == [True, False, True, False, None, False, True, None]
    assert (targets["note"] == "").all()  # every ratio measured
    missing = bench.target_ratios(medians, None, packed="packed-sdpa").set_index("ratio")
    for name in ("packed_5pct_over_replay", "packed_5pct_over_packed_replay", "packed_5pct_over_token_floor"):
        assert np.isnan(missing.loc[name, "value"]) and missing.loc[name, "met"] is None
        assert missing.loc[name, "note"] == "not measured: no packed-vs-Replay sweep"
    assert missing.loc["overlap_over_serial_recovery", "note"] == "not measured: no overlap comparison"
    assert missing.loc["attention_R16_over_unmasked", "note"] == "not measured: no attention-only timing"
    no_full = bench.target_ratios(medians, bench.replay_medians(sweep.iloc[:2]), packed="packed-sdpa")
    no_full = no_full.set_index("ratio")
    assert no_full.loc["packed_5pct_over_replay", "note"] == ""
    assert no_full.loc["packed_5pct_over_token_floor", "note"] == (
        "not measured: packed-sdpa not timed at a 100 % support")
    # A smoke grid times R = 1 and 4 only: the R = 16 ratios are NaN and say why; the R = 1 ratio is measured.
    smoke = bench.target_ratios(medians[medians.num_intervals != 16], replay, packed="packed-sdpa").set_index("ratio")
    for name in ("sequential_over_packed_R16", "packed_R16_over_R1"):
        assert np.isnan(smoke.loc[name, "value"]) and smoke.loc[name, "met"] is None
        assert smoke.loc[name, "note"] == "not measured: R = 16 not in num_intervals"
    assert smoke.loc["packed_R1_over_append_forward", "note"] == ""
    other = bench.target_ratios(medians, replay, context_len=2048, packed="packed-inplace", target_budget=2)
    assert other.set_index("ratio")["note"].tolist() == [
        "not measured: N = 2048 not in context_lengths"] * 3 + [
        "not measured: b = 2 % not in the sweep's budgets"] * 3 + [
        "not measured: no attention-only timing", "not measured: no overlap comparison"]
    unpacked = bench.target_ratios(medians, replay, packed="packed-inplace").set_index("ratio")
    assert unpacked.loc["packed_R16_over_R1", "note"] == "not measured: packed-inplace not timed"
    assert unpacked.loc["packed_5pct_over_replay", "note"] == "not measured: packed-inplace not in the sweep's executors"


def test_refresh_grid_and_replay_sweep_on_a_tiny_model():
    lm = make_tiny_model("qwen3")
    ctx = bench.prepare_context(lm, 96, prefix_len=8)
    executors = ["sequential", "direct-sequential", "one-shot", "packed-sdpa", "packed-flex-eager", "packed-triton"]
    timings, checks = bench.refresh_grid(lm, [ctx], num_selected=8, num_intervals=[1, 4], executors=executors,
                                         warmups=0, repeats=2)
    timed = [e for e in executors if e != "packed-triton"] if not torch.cuda.is_available() else executors
    assert len(timings) == len(timed) * 2 * 2
    assert timings["pairs"].nunique() == 1  # matched work across R
    assert checks["unselected_identical"].all()
    assert (checks["selected_max_abs"] <= 1e-9).all()
    sweep = bench.replay_sweep(lm, ctx, budgets=[5, 50], warmups=0, repeats=1, num_intervals=4)
    assert sorted(sweep["method"]) == ["Replay"] + ["packed-sdpa"] * 3 + ["packed-sdpa-split"] * 3
    assert sorted(sweep["num_selected"]) == [5, 5, 44, 44, 88, 88, 88]  # b = 100 %: the same-path Replay
    full = sweep[sweep.num_selected == 88]
    assert full["pairs"].nunique() == 1 and full["pairs"].iloc[0] == sum(range(8 + 1, 96 + 1))
    replay = bench.replay_medians(sweep)
    assert (replay[replay.budget_pct == 100.0].pair_fraction == 1.0).all()
    assert (replay[replay.method != "Replay"].fraction_of_packed_replay > 0).all()


def test_inplace_executors_floor_and_overlap_on_a_tiny_model():
    lm = make_tiny_model("qwen3")
    ctx = bench.prepare_context(lm, 96, prefix_len=8)
    before = clone_cache(ctx.shift)
    executors = ["sequential", "packed-inplace", "direct-sequential-inplace", bench.APPEND_FORWARD]
    timings, checks = bench.refresh_grid(lm, [ctx], num_selected=8, num_intervals=[1, 4], executors=executors,
                                         warmups=1, repeats=2)
    assert caches_equal(ctx.shift, before)  # in-place executors got copies
    assert checks["unselected_identical"].all() and (checks["selected_max_abs"] <= 1e-9).all()
    assert set(checks["executor"]) == {"sequential", "packed-inplace", "direct-sequential-inplace"}
    floor = timings[timings.executor == bench.APPEND_FORWARD]
    assert len(floor) == 2 and (floor["num_intervals"] == 1).all()
    assert (floor["pairs"] == sum(range(96 - 8 + 1, 96 + 1))).all()
    sweep = bench.replay_sweep(lm, ctx, budgets=[5], warmups=0, repeats=1, executors=["packed-inplace"],
                               full_support=False)
    assert sorted(sweep["method"]) == ["Replay", "packed-inplace"]
    assert caches_equal(ctx.shift, before)
    timings, summary = bench.overlap_recovery(lm, ctx.edit, budget_pct=10, warmups=1, repeats=2)
    assert sorted(summary["mode"]) == ["overlap", "serial"] and summary["identical"].all()
    assert len(timings) == 4 and timings[["select_ms", "shift_ms", "refresh_ms"]].notna().all().all()


def test_validation_helpers_on_a_tiny_model():
    lm = make_tiny_model("llama")
    ctx = bench.prepare_context(lm, 80, prefix_len=8)
    support = Support(np.r_[0:4, 30:33, 60:72], ctx.edit.suffix_len)
    summary, layers = validation.packed_vs_sequential(
        lm, ctx.edit, ctx.shift, support, ["packed-sdpa", "one-shot"]
    )
    assert summary["input_unchanged"].all() and summary["unselected_identical"].all()
    assert (summary["kv_max_abs"] <= 1e-9).all() and (summary["logits_rel_l2"] <= 1e-9).all()
    assert summary["logits_argmax_last_equal"].all()
    assert len(layers) == 2 * lm.spec.num_layers * 2
    same = validation.layer_errors(ctx.shift, clone_cache(ctx.shift), support.absolute(8))
    assert (same[["max_abs", "rms", "rel_l2"]] == 0).all().all()


def test_fp32_promotion_control_plumbing():
    """With the same executor as custom and native every ratio is exactly 1; the budget check then passes."""
    lm = validation.truncated_model(make_tiny_model("qwen3", dtype=torch.float32), 2, torch.bfloat16)
    assert lm.spec.num_layers == 2 and lm.dtype == torch.bfloat16
    edit = bench.synthetic_edit(lm.spec.vocab_size, 64, prefix_len=4)
    shift_cache = shift(lm, dirty(lm, edit), edit)
    support = Support(np.r_[3:9, 40:50], edit.suffix_len)
    ratios, summary = validation.fp32_promotion_control(lm, edit, shift_cache, support, custom="packed-sdpa")
    assert len(ratios) == (2 * 2 + 1) * 2
    assert (ratios["native"] > 0).all()  # BF16 really differs from the FP32 promotion
    assert (ratios["ratio"] == 1.0).all() and bool(summary["passed"].iloc[0])


def test_kernel_oracle_errors_small_cases():
    from sur_lab.executors.kernels import uses_triton

    cases = [c for c in validation.kernel_cases(max_len=160) if c.cache_len <= 160]
    df = validation.kernel_oracle_errors(cases[:3], (torch.float16, torch.bfloat16))
    assert len(df) == 6 and df["passed"].all()
    assert (df["backend"] == ("triton" if uses_triton("cpu") else "fallback")).all()
    assert df["fixed_ratio"].between(0, 1).all()


# ---------------------------------------------------------------------------------------------------------------------
# Tables 19 and 20 (issue 28)


def test_attention_only_backends_and_table19_layout():
    from sur_lab.executors.kernels import TRITON_INTERPRETED

    backends = ["sdpa-repeat", "sdpa-gqa", "split", "flex-eager", "onepass", "triton", "unmasked"]
    df = bench.attention_only(160, 2, num_selected=8, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                              device="cpu", backends=backends, warmups=0, repeats=1)
    names = set(df["backend"])
    assert {"sdpa-repeat", "sdpa-gqa", "flex-eager", "unmasked"} <= names
    assert "triton" not in names  # on a CPU only the interpreter runs, named apart
    assert ("triton-interpreter" in names) == TRITON_INTERPRETED
    checked = df[df.backend != "unmasked"]
    assert (checked["max_abs_vs_fp64"] < 1e-5).all()  # float32 outputs against the FP64 oracle
    wide = bench.table19(df)
    assert wide.index.tolist() == [(160, 2)]
    labels = [bench.TABLE19_LABELS[b] for b in bench.TABLE19_LABELS if b in names]
    assert list(wide.columns) == labels
    assert wide.loc[(160, 2), "SDPA + GQA"] == df.loc[df.backend == "sdpa-gqa", "median_us"].iloc[0]
    with pytest.raises(ValueError, match="lacks columns"):
        bench.table19(df.drop(columns="median_us"))


def test_real_input_recovery_and_table20_on_a_tiny_model():
    from sur_lab.edits import token_edit

    lm = make_tiny_model("qwen3")
    g = torch.Generator().manual_seed(0)
    edits = [token_edit(torch.randint(0, 96, (n,), generator=g), 12, 4, torch.randint(0, 96, (5,), generator=g))
             for n in (90, 120)]
    timings = bench.real_input_recovery(lm, edits, budgets=[10, 30], executors=["sequential", "packed"],
                                        warmups=1, repeats=2, labels=["a", "b"])
    assert len(timings) == 2 * (2 * 2 + 2) * 2
    sur = timings[timings.method == "SUR"]
    seq = sur[sur.executor == "sequential"]
    assert (seq["traversals"] == seq["num_intervals"]).all() and (sur[sur.executor == "packed"].traversals == 1).all()
    assert (sur["refresh_ms"] <= sur["recovery_ms"]).all()
    refs = timings[timings.method != "SUR"]
    assert (refs["refresh_ms"] == refs["recovery_ms"]).all() and refs["budget_pct"].isna().all()
    # The same support whichever executor refreshes it: B and R per input and budget agree.
    per = sur.groupby(["input", "budget_pct"])[["num_selected", "num_intervals"]].nunique()
    assert (per == 1).all().all()
    table = bench.table20(timings)
    assert len(table) == 6 and (table["inputs"] == 2).all()
    row = table[(table.method == "SUR") & (table.budget_pct == 10) & (table.executor == "packed")].iloc[0]
    medians = sur[(sur.budget_pct == 10) & (sur.executor == "packed")].groupby("input")["recovery_ms"].median()
    assert row["recovery_ms"] == pytest.approx(medians.mean())
    assert set(table["row"]) >= {"full-suffix Replay", "clean Re-prefill", "SUR 10 %, interval-wise",
                                 "SUR 30 %, packed"}
    with pytest.raises(ValueError, match="edits is empty"):
        bench.real_input_recovery(lm, [])
    with pytest.raises(ValueError, match="labels"):
        bench.real_input_recovery(lm, edits, labels=["a"])
