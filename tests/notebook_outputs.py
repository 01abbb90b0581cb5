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

from sur_lab.studies.noprefix import ROBUSTNESS_LABELS

#: Notebooks whose studies are being rebuilt (issue 23, the experiment pipeline): the smoke test checks only that they
#: write a figure and a table until their entries are declared here; one with an entry has its outputs checked, but
#: its generated "This run:" summary is required only once it leaves this set (issue 29: its conclusion moves to a
#: generated cell).
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


def _agent_reference(df: pd.DataFrame, params: dict) -> None:
    ref = df[df["arm"] == "Re-prefill"]
    assert len(ref) == 1
    assert float(ref["agree_pct"].iloc[0]) == 100.0, "Re-prefill must agree with itself"
    assert float(ref["token_exact_pct"].iloc[0]) == 100.0
    assert float(ref["cost_ratio"].iloc[0]) == 1.0
    assert (df["cost_ratio"] <= 1.0 + 1e-12).all()


def _noprefix(params: dict) -> dict:
    """Notebook 06's study parameters: its preset's sizes with the run's non-None parameters."""
    from sur_lab.studies import noprefix

    known = set(noprefix.params(params["preset"]))
    return noprefix.params(params["preset"], **{k: v for k, v in params.items() if k in known})


def _noprefix_rows(params: dict) -> int:
    """Per workload: full prefill, then every configuration (prefix composition included) under every protocol."""
    from sur_lab.studies.noprefix import default_specs

    p = _noprefix(params)
    return len(p["datasets"]) * len(p["num_docs"]) * (1 + len(default_specs(p["budgets"])) * len(p["protocols"]))


def _noprefix_endpoints(df: pd.DataFrame, params: dict) -> None:
    timed = df[df["timed"] > 0]
    assert (timed["ttfl_p95_ms"] >= timed["ttfl_ms"] - 1e-9).all(), "p95 below the median"
    assert (timed["full_ttfl_p95_ms"] >= timed["full_ttfl_ms"] - 1e-9).all()


def _noprefix_stratum(df: pd.DataFrame, params: dict) -> None:
    assert (df["n_correct"] <= df["n"]).all()
    assert (df["preservation_correct"].isna() == (df["n_correct"] == 0)).all(), "stratum values iff stratum requests"


def _noprefix_gate(df: pd.DataFrame, params: dict) -> None:
    for _, g in df.groupby("workload"):
        assert list(g["protocol"]) == ["forward", "forward", "donor"] and g["path"].iloc[0] == "Full prefill"
        donor, forward = g["preservation"].iloc[2], g["preservation"].iloc[1]
        # One donor and one forward row per source: the paired mean difference is the difference of the means.
        assert abs(g["donor_minus_forward"].iloc[0] - (donor - forward)) < 1e-12
        assert (g["gap_ci_low"] <= g["donor_minus_forward"] + 1e-12).all()
        assert (g["donor_minus_forward"] <= g["gap_ci_high"] + 1e-12).all()


def _noprefix_ledger(df: pd.DataFrame, params: dict) -> None:
    rows = df.set_index("experiment")
    assert "Hybrid vs query- and risk-guided start (suffix K2)" in rows.index
    assert "donor − forward" in rows.loc["Donor-copy vs actual forwarding (suffix K1, risk)", "key_result"]


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
    "06_noprefix_reuse": Expected(
        figures=("06_noprefix_local_vs_suffix", "06_noprefix_position_sweep", "06_noprefix_pareto_ttfl",
                 "06_noprefix_robustness"),
        tables={
            "06_noprefix_endpoints": Table(
                columns=("workload", "label", "protocol", "n", "preservation", "ci_low", "ci_high", "timed",
                         "ttfl_ms", "ttfl_p95_ms", "full_ttfl_ms", "full_ttfl_p95_ms"),
                rows=_noprefix_rows, not_null=("preservation", "ci_low", "ci_high"), check=_noprefix_endpoints),
            "06_noprefix_em_correct": Table(
                columns=("workload", "label", "protocol", "n", "preservation", "n_correct", "preservation_correct",
                         "ci_low_correct", "ci_high_correct"),
                rows=_noprefix_rows, not_null=("n_correct", "preservation"), check=_noprefix_stratum),
            "06_noprefix_quality_gate": Table(
                columns=("workload", "path", "protocol", "n", "preservation", "ci_low", "ci_high", "token_exact",
                         "gold_em", "changed_wrong", "ttfl_ms", "ttfl_p95_ms", "donor_minus_forward", "gap_ci_low",
                         "gap_ci_high"),
                rows=lambda p: 3 * len(_noprefix(p)["datasets"]),  # full prefill, forward, donor per dataset
                not_null=("preservation", "donor_minus_forward", "gap_ci_low", "gap_ci_high"), check=_noprefix_gate),
            "06_noprefix_robustness": Table(
                columns=("model", "label", "protocol", "n", "preservation", "ci_low", "ci_high", "n_correct",
                         "preservation_correct"),
                # the study model and the robustness run, each: every robustness path under every protocol
                rows=lambda p: ((1 + (p["robustness_model"] != "none")) * len(ROBUSTNESS_LABELS)
                                * len(_noprefix(p)["protocols"])),
                not_null=("preservation", "n_correct"), check=_noprefix_stratum),
            "06_noprefix_design_ledger": Table(columns=("experiment", "key_result", "worked", "criterion"),
                                               rows=lambda p: 11, check=_noprefix_ledger),
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
}
