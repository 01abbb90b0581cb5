"""What each notebook's smoke run must write: one entry per notebook, read by ``tests/test_notebooks.py``.

Each entry names the figures (PNG and PDF) and tables (CSV) the notebook writes under ``outputs/`` (file stems before
the parameter tag, e.g. ``00_quickstart_methods`` for ``00_quickstart_methods_model-..._seed-0.csv``) and a few facts
about their contents: required columns, the row count implied by the parameters the run used (the notebook's
defaults overridden by its smoke parameters), columns that must hold no NaN, and checks of values that must hold on
any model (Re-prefill agrees with itself, the bound holds, the input cache is unchanged). ``token_views`` counts the
static token views (:func:`sur_lab.analysis.plotting.token_view`) the executed copy must hold, and every notebook with
an entry must end in a generated "This run:" summary.

A new notebook adds its entry here (the notebook test fails for a notebook without one, except those in ``PENDING``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

#: Notebooks whose studies are being rebuilt (issue 23, the experiment pipeline): the smoke test checks only that they
#: write a figure and a table until their entries are declared here.
PENDING = {"02_allocation_geometry", "03_natural_qa_latency", "06_noprefix_reuse"}


@dataclass(frozen=True)
class Table:
    """Expected facts about one written table.

    Attributes:
        columns: columns that must be present.
        rows: the exact row count, as a function of the run's parameters (None: at least one row).
        not_null: columns that must hold no NaN.
        check: ``check(df, params)`` asserting value facts.
    """

    columns: tuple[str, ...]
    rows: Callable[[dict], int] | None = None
    not_null: tuple[str, ...] = ()
    check: Callable[[pd.DataFrame, dict], None] | None = None


@dataclass(frozen=True)
class Expected:
    """Figures and tables a notebook writes, and the token views its executed copy shows."""

    figures: tuple[str, ...]
    tables: dict[str, Table] = field(default_factory=dict)
    token_views: int = 0


def _reprefill_agrees_with_itself(df: pd.DataFrame, params: dict) -> None:
    ref = df[df["method"] == "Re-prefill"]
    assert len(ref) == 1
    assert bool(ref["agree_reprefill"].iloc[0]), "Re-prefill must agree with itself"
    assert float(ref["tv_reprefill"].iloc[0]) == 0.0, "Re-prefill's first-token TV to itself must be 0"
    sur = df[df["method"] == "SUR"]
    assert sorted(sur["budget_pct"]) == sorted(float(b) for b in params["budgets"])
    assert (sur["allowance"] <= sur["suffix_len"]).all() and (sur["allowance"] > 0).all()


def _bound_holds(df: pd.DataFrame, params: dict) -> None:
    assert int(df["violations_beyond_rounding"].iloc[0]) == 0, "Proposition 14.1 violated beyond float64 rounding"
    assert int(df["rows"].iloc[0]) > 0


def _pairs_within_bound(df: pd.DataFrame, params: dict) -> None:
    assert (df["pair_ratio"] <= df["pair_ratio_bound"] * (1 + 1e-12)).all(), "Eq. 18 bound exceeded"
    assert (df["token_layer_ratio"] <= 1).all()


def _staleness_budget(df: pd.DataFrame, params: dict) -> None:
    shift = df[df["budget_pct"] == 0]
    assert (shift["keys_of_shift"] == 1.0).all(), "budget 0 is Shift itself"


def _bench_checks(df: pd.DataFrame, params: dict) -> None:
    assert df["unselected_identical"].all(), "an executor changed an unselected row"
    assert set(df["executor"]) >= {"sequential"}


def _overlap_identical(df: pd.DataFrame, params: dict) -> None:
    assert set(df["mode"]) == {"serial", "overlap"}
    assert df["identical"].all(), "overlapped recovery must give bitwise the serial support and cache"


def _packed_matches_sequential(df: pd.DataFrame, params: dict) -> None:
    assert df["input_unchanged"].all(), "an executor modified its input Shift cache"
    assert df["unselected_identical"].all(), "an executor changed an unselected row"
    assert df["logits_argmax_last_equal"].all()


def _kernel_passes(df: pd.DataFrame, params: dict) -> None:
    assert df["passed"].all(), df[~df["passed"]]
    assert set(df["dtype"]) == set(params["kernel_dtypes"])


def _agent_arms(params: dict) -> int:
    """Shift, SUR at each budget, the debt arm when debt_pct > 0, Re-prefill."""
    return 2 + len(params["budgets"]) + (1 if params["debt_pct"] > 0 else 0)


def _trace_sizes(params: dict) -> dict:
    """Notebook 10's resolved sizes (its size parameters default to None: the preset's)."""
    from sur_lab.studies import agent_traces

    return agent_traces.params(params["preset"], **{k: params.get(k) for k in ("n_traces", "turns")})


def _trace_paths(params: dict) -> int:
    """sync at each budget, sync 0 % (Shift), prefix reuse, re-prefill."""
    return len(params["budgets"]) + 3


def _trace_runs(df: pd.DataFrame, params: dict) -> None:
    ref = df[df["path"] == "re-prefill"]
    assert ref["agree"].all() and ref["token_exact"].all(), "re-prefill must agree with itself"
    assert (ref["recomputed"] == ref["tokens"]).all(), "re-prefill recomputes the whole prompt"
    first = df[df["turn"] == 0]
    assert (first["recomputed"] == first["tokens"]).all(), "turn 0 is a full prefill on every path"
    later = df[df["turn"] > 0]
    assert (later["recomputed"] <= later["tokens"]).all()
    prefix = later[later["path"] == "prefix reuse"]
    assert (prefix["recomputed"] == prefix["tokens"] - prefix["first_change"]).all(), "prefix reuse: from the change"


def _agent_reference(df: pd.DataFrame, params: dict) -> None:
    ref = df[df["arm"] == "Re-prefill"]
    assert len(ref) == 1
    assert float(ref["agree_pct"].iloc[0]) == 100.0, "Re-prefill must agree with itself"
    assert float(ref["token_exact_pct"].iloc[0]) == 100.0
    assert float(ref["cost_ratio"].iloc[0]) == 1.0
    assert (df["cost_ratio"] <= 1.0 + 1e-12).all()


EXPECTED: dict[str, Expected] = {
    "00_quickstart": Expected(
        figures=("00_quickstart_relevance", "00_quickstart_latency"),
        tables={"00_quickstart_methods": Table(
            columns=("label", "method", "budget_pct", "allowance", "prediction", "em", "agree_reprefill",
                     "tv_reprefill", "select_ms", "shift_ms", "refresh_ms", "answer_ms", "latency_ms", "model"),
            rows=lambda p: 4 + len(p["budgets"]),  # Dirty, Shift, Replay, Re-prefill + SUR per budget
            not_null=("prediction", "agree_reprefill", "tv_reprefill", "latency_ms", "answer_ms"),
            check=_reprefill_agrees_with_itself,
        )},
        token_views=1,
    ),
    "01_theory_bound": Expected(
        figures=("01_bound_scatter", "01_bound_slack", "01_eq28", "01_cost_ratios", "01_traversal_model",
                 "01_staleness_heatmap", "01_staleness_decay", "01_staleness_budget"),
        tables={
            "01_bound_rows": Table(columns=("budget_pct", "layer", "head", "lhs", "bound25", "bound25_26", "approx28"),
                                   not_null=("lhs", "bound25", "approx28")),
            "01_bound_summary": Table(columns=("rows", "frac_rows_hold", "violations_beyond_rounding", "median_slack"),
                                      rows=lambda p: 1, not_null=("frac_rows_hold",), check=_bound_holds),
            "01_eq28": Table(columns=("under", "over")),
            "01_cost_model": Table(columns=("budget_pct", "token_layer_ratio", "flops_ratio", "pair_ratio",
                                            "pair_ratio_bound"), not_null=("pair_ratio",), check=_pairs_within_bound),
            "01_timings": Table(columns=("executor", "R", "B", "ms"), not_null=("ms",)),
            "01_traversal_fit": Table(columns=("H_ms", "c0_ms", "r2"), rows=lambda p: 1, not_null=("H_ms",)),
            "01_staleness_distance": Table(columns=("layer", "distance", "keys", "values"), not_null=("keys",)),
            "01_staleness_budget": Table(
                columns=("method", "budget_pct", "keys_of_shift", "values_of_shift", "values_refreshed"),
                rows=lambda p: 2 * len(p["staleness_budgets"]),  # SUR and Dense tokens at each budget
                not_null=("keys", "values", "keys_of_shift"), check=_staleness_budget),
        },
    ),
    "04_packed_refresh_benchmark": Expected(
        figures=("04_refresh_vs_intervals", "04_packed_vs_replay"),
        tables={
            "04_checks": Table(columns=("executor", "selected_max_abs", "unselected_identical"),
                               rows=lambda p: len(p["context_lengths"]) * len(p["num_intervals"])
                               * len([e for e in p["executors"] if e != "append-forward"]),  # the floor is no repair
                               not_null=("selected_max_abs",), check=_bench_checks),
            "04_timings": Table(columns=("context_len", "num_intervals", "executor", "ms"), not_null=("ms",)),
            "04_table18": Table(columns=("context_len", "num_intervals", "sequential"),
                                rows=lambda p: len(p["context_lengths"]) * len(p["num_intervals"]),
                                not_null=("sequential",)),
            "04_packed_vs_replay": Table(
                columns=("method", "budget_pct", "median_ms", "fraction_of_replay", "token_fraction", "pair_bound"),
                # each executor at every budget and at a 100 % support (an exact Replay on that executor), beside Replay
                rows=lambda p: 1 + len(p["sweep_executors"]) * len({*map(float, p["budgets"]), 100.0}),
                not_null=("median_ms",)),
            "04_overlap": Table(columns=("mode", "median_ms", "identical"), rows=lambda p: 2, not_null=("median_ms",),
                                check=_overlap_identical),
            "04_targets": Table(columns=("ratio", "value", "target", "met", "note", "packed")),
        },
    ),
    "05_kernel_numerical_validation": Expected(
        figures=("05_packed_vs_sequential_by_layer", "05_kernel_vs_oracle", "05_fp32_promotion_control"),
        tables={
            "05_packed_vs_sequential": Table(
                columns=("context_len", "num_intervals", "executor", "input_unchanged", "unselected_identical",
                         "kv_max_rel_l2", "logits_rel_l2"),
                rows=lambda p: len(p["context_lengths"]) * len(p["num_intervals"]) * len(p["executors"]),
                not_null=("kv_max_rel_l2", "logits_rel_l2"), check=_packed_matches_sequential),
            "05_packed_vs_sequential_layers": Table(columns=("executor", "layer", "tensor", "rel_l2"),
                                                    not_null=("rel_l2",)),
            "05_kernel_vs_oracle": Table(columns=("case", "dtype", "passed", "sdpa_ratio"), check=_kernel_passes),
            "05_fp32_promotion_ratios": Table(columns=("quantity", "statistic", "native", "custom", "ratio"),
                                              not_null=("native", "custom")),
        },
    ),
    "07_agent_session": Expected(
        figures=("07_agent_session_quality", "07_agent_session_cumulative_cost", "07_agent_session_staleness",
                 "07_agent_session_cost_quality"),
        tables={
            "07_agent_session_runs": Table(
                columns=("episode", "edit", "arm", "forwarded_tokens", "prediction", "agree", "key_dev", "debt"),
                rows=lambda p: p["n_episodes"] * p["k"] * _agent_arms(p),
                not_null=("forwarded_tokens", "key_dev", "value_dev", "cost_ratio")),
            "07_agent_session_per_edit": Table(columns=("arm", "edit", "agree_pct", "cost_ratio", "key_dev"),
                                               rows=lambda p: p["k"] * _agent_arms(p), not_null=("agree_pct",)),
            "07_agent_session_summary": Table(
                columns=("arm", "n", "em_pct", "agree_pct", "token_exact_pct", "cost_ratio", "final_key_dev"),
                rows=_agent_arms, not_null=("agree_pct", "cost_ratio"), check=_agent_reference),
        },
        token_views=1,
    ),
    "10_agent_traces": Expected(
        figures=("10_agent_traces_cost_agreement", "10_agent_traces_regions"),
        tables={
            "10_agent_traces_runs": Table(
                columns=("trace", "turn", "edits", "path", "sync_path", "first_change", "region", "recomputed",
                         "ttft_ms", "prediction", "agree", "em", "cum_recomputed", "cost_ratio"),
                rows=lambda p: _trace_sizes(p)["n_traces"] * _trace_sizes(p)["turns"] * _trace_paths(p),
                not_null=("recomputed", "ttft_ms", "cum_ttft_ms", "cost_ratio"), check=_trace_runs),
            "10_agent_traces_per_turn": Table(columns=("path", "turn", "ttft_ms", "agree_pct", "cost_ratio"),
                                              rows=lambda p: _trace_sizes(p)["turns"] * _trace_paths(p),
                                              not_null=("ttft_ms", "agree_pct")),
            "10_agent_traces_regions": Table(columns=("region", "path", "turns", "ttft_ms", "speedup", "agree_pct",
                                                      "agree_diff_pp"), not_null=("ttft_ms", "speedup")),
            "10_agent_traces_summary": Table(
                columns=("path", "turns", "ttft_ms", "agree_pct", "em_pct", "cost_ratio", "time_ratio"),
                rows=_trace_paths, not_null=("agree_pct", "cost_ratio")),
        },
    ),
}
