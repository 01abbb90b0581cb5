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

import numpy as np
import pandas as pd

from sur_lab.studies.noprefix import ROBUSTNESS_LABELS

#: Notebooks whose entries are not declared yet: the smoke test checks only that they write a figure and a table.
#: Empty: every notebook declares its outputs (a new notebook adds its entry to ``EXPECTED`` instead).
PENDING: set[str] = set()


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


def _agent_decided(params: dict) -> int:
    """Notebook 07's decided comparisons (``agent_session.decide_families``): SUR at each budget against Shift, SUR at
    the lead budget against Re-prefill (equivalence within the declared margin), and the primary (the debt arm
    against SUR at its budget) when the debt arm ran at one of those budgets."""
    debt = params["debt_pct"] > 0 and float(params["debt_budget"]) in {float(b) for b in params["budgets"]}
    return len(params["budgets"]) + 1 + (1 if debt else 0)


def _trace_sizes(params: dict) -> dict:
    """Notebook 10's resolved sizes (its size parameters default to None: the preset's)."""
    from sur_lab.studies import agent_traces

    return agent_traces.STUDY.params(params["preset"], **{k: params.get(k) for k in ("n_traces", "turns")})


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


def _trace_kinds(df: pd.DataFrame, params: dict) -> None:
    from sur_lab.studies import agent_traces

    turns = _trace_sizes(params)["turns"]
    want = set(agent_traces.question_kinds(turns)[1:]) | {"all"}  # the later turns' kinds
    want |= {"reaching"} if want & set(agent_traces.REACHING) else set()
    assert set(df["kind"]) == want, sorted(set(df["kind"]))
    ref = df[df["path"] == "re-prefill"]
    assert (ref["agree_pct"] == 100.0).all(), "re-prefill must agree with itself"


def _agent_reference(df: pd.DataFrame, params: dict) -> None:
    ref = df[df["arm"] == "Re-prefill"]
    assert len(ref) == 1
    assert float(ref["agree_pct"].iloc[0]) == 100.0, "Re-prefill must agree with itself"
    assert float(ref["token_exact_pct"].iloc[0]) == 100.0
    assert float(ref["cost_ratio"].iloc[0]) == 1.0
    assert (df["cost_ratio"] <= 1.0 + 1e-12).all()


def study_params(study: str, p: dict) -> dict:
    """A study notebook's resolved parameters: its preset's sizes with the run's non-None overrides
    (the study's ``params``), so row counts follow the presets wherever they are edited."""
    from sur_lab.studies import get_study

    s = get_study(study)
    known = {**s.fixed, **s.presets[p["preset"]]}
    return s.params(p["preset"], **{k: v for k, v in p.items() if k in known})


def _niah_arms(p: dict) -> tuple[int, int, int]:
    """(references, budgeted methods, budgets) of a notebook-02 run."""
    q = study_params("niah", p)
    from sur_lab.studies import niah

    from sur_lab.repair import REFERENCE_OPERATORS

    methods = niah.STUDY.methods(q)
    refs = [m for m in methods if m in REFERENCE_OPERATORS]  # Erratum has no budget, listed among the allocators
    return len(refs), len(methods) - len(refs), len(q["budgets"])


def _niah_records(df: pd.DataFrame, params: dict) -> None:
    ref = df[df["method"] == "Re-prefill"]
    assert len(ref) and ref["agree_reprefill"].astype(bool).all(), "Re-prefill must agree with itself"
    assert (ref["tv_reprefill"] == 0).all(), "Re-prefill's first-token TV to itself must be 0"
    budgeted = df[df["budget_pct"].notna()]
    assert ((budgeted["allowance"] > 0) & (budgeted["allowance"] <= budgeted["suffix_len"])).all()
    assert set(df["em"].astype(float)) <= {0.0, 1.0}


def _reference_row_is_100(column: str, row: str = "Re-prefill", col: str = "method"):
    def check(df: pd.DataFrame, params: dict) -> None:
        value = df.loc[df[col] == row, column]
        assert len(value) == 1 and float(value.iloc[0]) == 100.0, f"{row} must agree with itself: {value.tolist()}"
    return check


def _intervals_contain_estimate(diff: str, low: str, high: str):
    def check(df: pd.DataFrame, params: dict) -> None:
        eps = 1e-9
        assert ((df[low] <= df[diff] + eps) & (df[diff] <= df[high] + eps)).all(), df[[diff, low, high]]
    return check


def _concordance_counts(df: pd.DataFrame, params: dict) -> None:
    pairs = df["concordant"] + df["discordant"] + df["tied"]
    assert pairs.nunique() == 1 and int(pairs.iloc[0]) > 0, "every model and budget counts the same pairs of rules"


def _decided(df: pd.DataFrame, params: dict) -> None:
    """Rows of :func:`sur_lab.analysis.decisions.paired_family`: known verdicts, intervals around the estimate with a
    nonzero width (never a zero-width interval), and nothing decided at the plumbing-check size."""
    from sur_lab.analysis.decisions import NOT_DECIDED, VERDICTS, decides

    assert set(df["verdict"]) <= set(VERDICTS), set(df["verdict"])
    has = df["ci_low"].notna()
    binary = has & (df["kind"] == "binary")  # Newcombe's interval holds its estimate; a percentile one need not
    assert ((df["ci_low"] <= df["estimate"] + 1e-9) & (df["estimate"] <= df["ci_high"] + 1e-9))[binary].all()
    assert (df["ci_high"] > df["ci_low"])[has].all(), "a zero-width interval"
    if not decides(params.get("preset")):
        assert (df["verdict"] == NOT_DECIDED).all(), "a smoke run decides nothing"


#: The columns of a decided family (:data:`sur_lab.analysis.decisions.COLUMNS`).
DECIDED = ("family", "comparison", "a", "b", "kind", "estimate", "ci_low", "ci_high", "p", "p_adj", "n",
           "n_discordant", "family_size", "verdict")


def _nqa(p: dict) -> tuple[int, int, int, int]:
    """(cases, timed cases, references, budgeted conditions) of a notebook-03 run."""
    from sur_lab.studies import natural_qa

    q = study_params("natural-qa", p)
    methods, _ = natural_qa.available_methods(q["allocators"], q["references"])
    refs = [m for m in methods if m in q["references"]]
    per_source = len(q["placements"])
    cases = len(q["datasets"]) * q["n_per_dataset"] * per_source
    timed = len(q["datasets"]) * min(q["timed_sources"], q["n_per_dataset"]) * per_source
    return cases, timed, len(refs), (len(methods) - len(refs)) * len(q["budgets"])


def _nqa_conditions(p: dict) -> int:
    _, _, refs, budgeted = _nqa(p)
    return refs + budgeted


def _nqa_records(p: dict) -> int:
    cases, timed, refs, budgeted = _nqa(p)
    trials = study_params("natural-qa", p)["trials"]
    return (refs + budgeted) * (cases + (trials - 1) * timed)


def _nqa_paired_rows(p: dict) -> int:
    q = study_params("natural-qa", p)
    refs = len(q["references"])
    return len(q["budgets"]) * (refs + len([r for r in q["references"] if r != "Re-prefill"]))


def _transitions_add_up(df: pd.DataFrame, params: dict) -> None:
    assert (df["repairs"] + df["regressions"] + df["both_correct"] + df["both_wrong"] == df["n"]).all()
    assert set(df["metric"]) == {"EM", "agreement"}


def _table7(df: pd.DataFrame, params: dict) -> None:
    ref = df[df["condition"] == "Re-prefill"]
    assert len(ref) == 1 and float(ref["agree_pct"].iloc[0]) == 100.0, "Re-prefill must agree with itself"
    assert float(ref["speedup_vs_reference"].iloc[0]) == 1.0


def _noprefix_workloads(p: dict) -> int:
    q = study_params("noprefix", p)
    return len(q["datasets"]) * len(q["num_docs"])


def _full_prefill_preserves_itself(df: pd.DataFrame, params: dict) -> None:
    full = df[df["label"] == "Full prefill"]
    assert len(full) and (full["preservation"] == 1).all() and (full["token_exact"] == 1).all()
    assert ((df["repair_ratio"] >= 0) & (df["repair_ratio"] <= 1 + 1e-12)).all()


def _operating_rule(df: pd.DataFrame, params: dict) -> None:
    assert set(df["serve"]) <= {"repair", "full prefill"}
    served = df[df["serve"] == "repair"]
    assert not served["label"].str.contains("oracle").any(), "an oracle-selected path is never served"
    assert (df.loc[df["serve"] == "full prefill", "label"] == "Full prefill").all()
    from sur_lab.analysis.decisions import decides

    if not decides(params.get("preset")):
        assert (df["serve"] == "full prefill").all() and df["reason"].str.startswith("not decided").all()


def _evidence_params(params: dict) -> dict:
    """Notebook 08's resolved study parameters: the preset's sizes with the run's non-None overrides."""
    from sur_lab.studies import evidence_location

    sizes = evidence_location.PRESETS["default"]
    return evidence_location.STUDY.params(params["preset"], **{k: params.get(k) for k in sizes})


def _evidence_cells(params: dict) -> int:
    p = _evidence_params(params)
    return 4 * p["sources_per_dataset"] * len(p["datasets"])


def _evidence_methods(params: dict) -> int:
    p = _evidence_params(params)
    return len(p["references"]) + int(bool(p["fixed_slot"])) + len(p["allocators"]) * len(p["budgets"])


def _evidence_records(df: pd.DataFrame, params: dict) -> None:
    ref = df[df["method"] == "Re-prefill"]
    assert len(ref) == _evidence_cells(params)
    assert ref["logits_identical"].all() and ref["sequence_agree"].all() and ref["argmax_agree"].all()
    assert (ref["jsd_reprefill"] == 0).all() and (ref["tv_reprefill"] == 0).all()
    fixed = df[df["method"] == "Fixed slot"]
    assert (fixed["allowance"] == fixed["slot_width"]).all(), "the fixed slot refreshes exactly W positions"
    assert (df["gold_tokens"] == df["answer_len"]).all() and (df["gold_nll"] >= 0).all()


def _evidence_table15(df: pd.DataFrame, params: dict) -> None:
    assert set(df["hypothesis"]) == {f"{e} {c}" for e in ("NLL", "EM") for c in ("side", "tail", "interaction")}
    assert df.loc[df["hypothesis"] == "NLL side", "p_adj"].isna().all(), "the primary is not Holm-corrected"
    nll = df[df["endpoint"] == "NLL"]
    assert (nll["n_clusters"] == _evidence_cells(params) // 4).all() and (nll["n"] == nll["n_clusters"]).all()
    assert (nll["unit"] == "nats").all() and (df.loc[df["endpoint"] == "EM", "unit"] == "pp").all()


def _evidence_findings(df: pd.DataFrame, params: dict) -> None:
    from sur_lab.analysis.decisions import decides

    if not decides(params.get("preset")):
        assert df["reproduced"].isna().all() and (df["verdict"] == "not decided at this size").all()


def _paths_spec(params: dict) -> dict:
    from sur_lab.studies import execution_paths

    return execution_paths.PRESETS[params["paths_preset"]]


def _paths_cells(params: dict) -> int:
    spec = _paths_spec(params)
    return 4 * spec["sources_per_dataset"] * len(spec["datasets"])


def _table17_cpu(df: pd.DataFrame, params: dict) -> None:
    assert set(df["dtype"]) == set(_paths_spec(params)["dtypes"])
    assert (df["cells"] == _paths_cells(params)).all()
    assert ((df["excess_pp"] - (df["cross_pct"] - df["reprefill_pct"])).abs() < 1e-9).all()
    if params.get("device", "cpu") == "cpu":  # fixed shapes and threads: deterministic kernels
        assert (df[["shared_pct", "reprefill_pct", "replay_pct"]] == 0).all().all(), "within-path disagreement on CPU"
def _stale_params(p: dict) -> dict:
    """Notebook 09's study parameters for the run's values (preset sizes where the notebook left None)."""
    from sur_lab.studies import stale_facts

    keys = ("context_lens", "num_cases", "edit_depths", "distances", "num_keys", "budgets", "allocators",
            "max_new_tokens", "families", "references", "erratum_template")
    return stale_facts.STUDY.params(p["preset"], **{k: p.get(k) for k in keys})


def _stale_late_cases(p: dict) -> int:
    """Cases that run the Erratum placement control (issue 40): the replacement cases (every family but
    superseded_tool_output; the roster cycles the families), when Erratum is a reference."""
    q = _stale_params(p)
    fams = q["families"]
    if "Erratum" not in q["references"]:
        return 0
    return sum(fams[i % len(fams)] != "superseded_tool_output" for i in range(q["num_cases"]))


def _stale_records(p: dict) -> int:
    q = _stale_params(p)
    return (q["num_cases"] * (len(q["references"]) + len(q["allocators"]) * len(q["budgets"]))
            + 2 * _stale_late_cases(p))  # Shift (late) and Re-prefill (late)


def _stale_pairs(p: dict) -> int:
    """Declared comparisons: the primary (SUR at 5 % minus Shift, EM), the compared arms minus SUR on EM at each
    budget, and every compared arm minus Shift on the stale rate (Erratum once)."""
    from sur_lab.studies.stale_facts import COMPARED, PRIMARY_BUDGET

    q = _stale_params(p)
    budgeted = [m for m in COMPARED if m in q["allocators"]]
    u, n_b, shift = int("Erratum" in q["references"]), len(q["budgets"]), "Shift" in q["references"]
    primary = int("SUR" in budgeted and PRIMARY_BUDGET in q["budgets"] and shift)
    em = (len(budgeted) - 1 + u) * n_b if "SUR" in budgeted else 0
    placement = 2 if _stale_late_cases(p) else 0  # Re-prefill (late) and Shift (late) minus Erratum
    return primary + em + ((len(budgeted) * n_b + u) if shift else 0) + placement


def _stale_records_check(df: pd.DataFrame, params: dict) -> None:
    ref = df[df["method"] == "Re-prefill"]
    assert ref["agree_reprefill"].all(), "Re-prefill must agree with itself"
    assert (df.loc[df["method"] == "Shift", "margin_recovery"].dropna() == 0).all()
    assert (ref["margin_recovery"].dropna() == 1).all()
    before = df["num_tokens"] - df["inserted_len"]  # the context before the edit (a replacement's Dirty)
    dirty = df["method"] == "Dirty"
    assert (df.loc[dirty, "cache_len"] == before[dirty]).all()
    err = df["method"] == "Erratum"
    assert (df.loc[err, "note_tokens"] > 0).all() and (df.loc[err, "note_template"] == params["erratum_template"]).all()
    assert (df.loc[err, "cache_len"] == before[err] + df.loc[err, "note_tokens"]).all()
    assert (df.loc[~err, "note_tokens"] == 0).all()
    assert set(df["answer_class"]) <= {"correct", "stale", "mixed", "distractor", "wrong"}
    assert (df["em"] == (df["answer_class"] == "correct")).all()
    late = df["method"].str.endswith(" (late)")
    assert set(df.loc[late, "method"]) <= {"Shift (late)", "Re-prefill (late)"}
    assert df.loc[df["method"] == "Re-prefill (late)", "agree_reprefill"].all()
    # The control's context is a permutation of the edit's: the same length.
    shift = df[df["method"] == "Shift"].set_index("case_id")["cache_len"]
    shift_late = df[df["method"] == "Shift (late)"].set_index("case_id")["cache_len"]
    assert (shift_late == shift[shift_late.index]).all()
    assert np.isfinite(df["old_margin"]).all()  # every stale-fact case declares its old token


def _table20_checks(df: pd.DataFrame, params: dict) -> None:
    refs = df[df["method"].isin(["Replay", "Re-prefill"])]
    assert sorted(refs["method"]) == ["Re-prefill", "Replay"]
    assert (refs["refresh_ms"] == refs["recovery_ms"]).all(), "a reference operator has no selection stage"
    sur = df[~df["method"].isin(["Replay", "Re-prefill"])]
    assert (sur["refresh_ms"] <= sur["recovery_ms"]).all(), "recovery includes the refresh"
    interval_wise = sur[sur["executor"] == "sequential"]
    assert (interval_wise["traversals"] == interval_wise["num_intervals"]).all(), "one traversal per interval"
    assert (sur.loc[sur["executor"] != "sequential", "traversals"] == 1).all(), "packed refresh traverses once"
    assert (df["inputs"] == len(params["qa_datasets"])).all()


def _niah_params(params: dict) -> dict:
    """Notebook 02's study parameters for a run's parameter values (the preset's lists where the notebook gave None)."""
    from sur_lab.studies import niah

    keys = ("ablation", "matched_allocators", "budgets", "matched_budgets", "context_lens")
    return niah.STUDY.params(params["preset"], **{k: params.get(k) for k in keys})


def _ablation_matched(df: pd.DataFrame, params: dict) -> None:
    p = _niah_params(params)
    rows = [m for m in p["ablation"] if m != "SUR"]
    for metric, sub in df.groupby("metric"):
        assert sorted(sub["method"].unique()) == sorted(rows), metric
        assert len(sub) == len(rows) * len(p["budgets"]), metric
    same_count = df[~df["method"].str.contains("allowance_base=prompt", regex=False)]
    assert (same_count["mean_tokens"] == same_count["reference_tokens"]).all(), "a control did not get SUR's count"
    assert (df["delta_low"] <= df["delta"] + 1e-9).all() and (df["delta"] <= df["delta_high"] + 1e-9).all()
    assert set(df["unit"]) == {"pp"}, set(df["unit"])


def _table14_rows(params: dict) -> int:
    """Pooled rows, then one block per context length (issue 40)."""
    p = _niah_params(params)
    return (1 + len(p["context_lens"])) * len(p["matched_allocators"]) * len(p["matched_budgets"])


def _table14_counts_rows(params: dict) -> int:
    p = _niah_params(params)
    return (1 + len(p["context_lens"])) * len(p["matched_budgets"])


def _table14(df: pd.DataFrame, params: dict) -> None:
    """Every pooled row is the matched family's and every per-length row the by-length family's; each row's matched
    count is at least its mean B (SUR's whole units reach B)."""
    from sur_lab.studies import niah

    assert set(df.loc[df["length"] == "all", "family"]) == {niah.MATCHED.name}
    assert set(df.loc[df["length"] != "all", "family"]) == {niah.MATCHED_BY_LENGTH.name}
    assert (df["mean_tokens"] >= df["mean_b"]).all()


def _noprefix(params: dict) -> dict:
    """Notebook 06's study parameters: its preset's sizes with the run's non-None parameters."""
    from sur_lab.studies import noprefix

    known = set(noprefix.STUDY.params(params["preset"]))
    return noprefix.STUDY.params(params["preset"], **{k: v for k, v in params.items() if k in known})


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
    assert rows.loc["Donor-copy vs actual forwarding (suffix K1, risk)", "key_result"].startswith("donor ")
    assert set(rows["verdict"]) <= {"worked", "did not", "not separated", "not shown", "not run", "not decided"}
    from sur_lab.analysis.decisions import decides

    if not decides(params.get("preset")):
        assert set(rows["verdict"]) <= {"not run", "not decided"}, "a smoke run decides nothing"


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
    "02_allocation_geometry": Expected(
        figures=("02_budget_curves", "02_budget_heatmap", "02_paired_differences", "02_intervals",
                 "02_fidelity_curves", "02_ablation", "02_table14_counts"),
        tables={
            "02_ablation": Table(
                columns=("method", "factor", "change", "budget_pct", "mean_tokens", "reference_tokens", "value",
                         "reference_value", "delta", "delta_low", "delta_high", "unit", "n", "metric", "verdict"),
                not_null=("delta", "delta_low", "delta_high", "mean_tokens"),
                check=lambda df, p: (_ablation_matched(df, p), _decided(df, p))),
            "02_table14": Table(
                columns=("length", "family", "budget_pct", "allocator", "mean_tokens", "mean_b", "n", "unit",
                         "em_region", "em_token", "em_delta", "em_delta_low", "em_delta_high",
                         "agree_reprefill_region", "agree_reprefill_token", "agree_reprefill_delta",
                         "agree_reprefill_delta_low", "agree_reprefill_delta_high", "em_verdict",
                         "agree_reprefill_verdict", "em_delta_mde"),
                rows=_table14_rows, not_null=("mean_tokens", "mean_b", "em_delta", "agree_reprefill_delta",
                                              "em_verdict"), check=_table14),
            "02_table14_counts": Table(
                columns=("length", "budget_pct", "cases", "mean_b", "min_count", "median_count", "mean_count",
                         "max_count", "distinct_counts", "share_at_b"),
                rows=_table14_counts_rows, not_null=("mean_b", "mean_count")),
            "02_niah_cases": Table(columns=("case_id", "N", "p", "d", "S"),
                                   rows=lambda p: study_params("niah", p)["num_cases"], not_null=("S",)),
            "02_niah_records": Table(
                columns=("case_id", "method", "budget_pct", "allowance", "num_intervals", "prediction", "em",
                         "agree_reprefill", "tv_reprefill", "nll_reprefill"),
                rows=lambda p: study_params("niah", p)["num_cases"] * (
                    _niah_arms(p)[0] + _niah_arms(p)[1] * _niah_arms(p)[2]),
                not_null=("em", "agree_reprefill", "tv_reprefill", "nll_reprefill", "gold_nll", "gold_margin"),
                check=_niah_records),
            "02_beyond_paper_differences": Table(columns=DECIDED, not_null=("a", "b", "verdict"), check=_decided),
            "02_decisions": Table(columns=DECIDED, not_null=("a", "b", "verdict"), check=_decided),
            "02_table12": Table(columns=("rule",)),
            "02_table12_concordance": Table(columns=("budget", "paper_model", "concordant", "discordant", "tied"),
                                            check=_concordance_counts),
            "02_budget_table_agreement": Table(columns=("method", "Reference"), rows=lambda p: sum(_niah_arms(p)[:2]),
                                               check=_reference_row_is_100("Reference")),
            "02_budget_table_em": Table(columns=("method", "Reference"), rows=lambda p: sum(_niah_arms(p)[:2])),
            "02_paired_differences": Table(
                columns=("method", "budget_pct", "baseline", "delta", "delta_low", "delta_high", "unit", "n",
                         "verdict"),
                rows=lambda p: _niah_arms(p)[1] * _niah_arms(p)[2] * 2,  # against Shift and Re-prefill
                not_null=("delta", "delta_low", "delta_high"),
                check=lambda df, p: (_intervals_contain_estimate("delta", "delta_low", "delta_high")(df, p),
                                     _decided(df, p))),
            "02_selection_cost": Table(columns=("method", "median_R", "select_ms", "refresh_ms"),
                                       rows=lambda p: _niah_arms(p)[1], not_null=("median_R", "refresh_ms")),
            "02_sur_vs_allocators": Table(  # the conclusion's generated cell: SUR's own family
                columns=DECIDED, not_null=("a", "b", "verdict"), check=_decided),
        },
    ),
    "03_natural_qa_latency": Expected(
        figures=("03_figure4_quality_latency", "03_latency_breakdown", "03_error_transitions"),
        tables={
            "03_natural_qa_cases": Table(columns=("dataset", "source_id", "placement", "timed", "p", "d", "S"),
                                         rows=lambda p: _nqa(p)[0], not_null=("S",)),
            "03_natural_qa_records": Table(columns=("case_id", "method", "budget_pct", "em", "agree_reprefill"),
                                           rows=_nqa_records, not_null=("em", "agree_reprefill")),
            "03_table7_quality_latency": Table(
                columns=("condition", "cases", "em_pct", "agree_pct", "timed_cases", "latency_ms",
                         "speedup_vs_reference"),
                rows=_nqa_conditions, not_null=("em_pct", "agree_pct", "latency_ms"), check=_table7),
            "03_table10_em_by_dataset": Table(columns=("condition", "Pooled", "cases"), rows=_nqa_conditions,
                                              not_null=("Pooled",)),
            "03_table10_agreement_by_dataset": Table(columns=("condition", "Pooled", "cases"), rows=_nqa_conditions,
                                                     not_null=("Pooled",),
                                                     check=_reference_row_is_100("Pooled", col="condition")),
            "03_decisions": Table(columns=DECIDED, not_null=("a", "b", "verdict"), check=_decided),
            "03_table9_paired_differences": Table(
                columns=("budget_pct", "reference", "delta", "delta_low", "delta_high", "unit", "n", "n_clusters",
                         "metric"),
                rows=_nqa_paired_rows, not_null=("delta", "delta_low", "delta_high"),
                check=_intervals_contain_estimate("delta", "delta_low", "delta_high")),
            "03_error_transitions": Table(
                columns=("condition", "repairs", "regressions", "both_correct", "both_wrong", "n", "metric"),
                rows=lambda p: 2 * (_nqa_conditions(p) - 1), check=_transitions_add_up),  # each against Shift
        },
    ),
    "04_packed_refresh_benchmark": Expected(
        figures=("04_refresh_vs_intervals", "04_packed_vs_replay"),
        tables={
            "04_checks": Table(columns=("executor", "selected_max_abs", "unselected_identical"),
                               rows=lambda p: len(p["context_lens"]) * len(p["num_intervals"])
                               * len([e for e in p["executors"] if e != "append-forward"]),  # the floor is no repair
                               not_null=("selected_max_abs",), check=_bench_checks),
            "04_timings": Table(columns=("context_len", "num_intervals", "executor", "ms"), not_null=("ms",)),
            "04_table18": Table(columns=("context_len", "num_intervals", "sequential"),
                                rows=lambda p: len(p["context_lens"]) * len(p["num_intervals"]),
                                not_null=("sequential",)),
            "04_packed_vs_replay": Table(
                columns=("method", "budget_pct", "median_ms", "fraction_of_replay", "token_fraction", "pair_bound"),
                # each executor at every budget and at a 100 % support (an exact Replay on that executor), beside Replay
                rows=lambda p: 1 + len(p["sweep_executors"]) * len({*map(float, p["budgets"]), 100.0}),
                not_null=("median_ms",)),
            "04_overlap": Table(columns=("mode", "median_ms", "identical"), rows=lambda p: 2, not_null=("median_ms",),
                                check=_overlap_identical),
            "04_targets": Table(columns=("ratio", "value", "target", "met", "note", "packed")),
            "04_table19": Table(columns=("device", "context_len", "num_intervals", "SDPA + GQA"),
                                rows=lambda p: len(p["context_lens"]) * len(p["num_intervals"]),  # CPU only here
                                not_null=("SDPA + GQA",)),
            "04_table20": Table(
                columns=("row", "method", "budget_pct", "executor", "inputs", "num_selected", "num_intervals",
                         "traversals", "refresh_ms", "recovery_ms"),
                rows=lambda p: len(p["qa_budgets"]) * len(p["qa_executors"]) + 2,  # SUR rows, Replay, Re-prefill
                not_null=("refresh_ms", "recovery_ms", "traversals"), check=_table20_checks),
        },
    ),
    "05_kernel_numerical_validation": Expected(
        figures=("05_packed_vs_sequential_by_layer", "05_kernel_vs_oracle", "05_fp32_promotion_control", "05_table17"),
        tables={
            "05_packed_vs_sequential": Table(
                columns=("context_len", "num_intervals", "executor", "input_unchanged", "unselected_identical",
                         "kv_max_rel_l2", "logits_rel_l2"),
                rows=lambda p: len(p["context_lens"]) * len(p["num_intervals"]) * len(p["executors"]),
                not_null=("kv_max_rel_l2", "logits_rel_l2"), check=_packed_matches_sequential),
            "05_packed_vs_sequential_layers": Table(columns=("executor", "layer", "tensor", "rel_l2"),
                                                    not_null=("rel_l2",)),
            "05_kernel_vs_oracle": Table(columns=("case", "dtype", "passed", "sdpa_ratio"), check=_kernel_passes),
            "05_fp32_promotion_ratios": Table(columns=("quantity", "statistic", "native", "custom", "ratio"),
                                              not_null=("native", "custom")),
            "05_execution_paths": Table(
                columns=("model", "dtype", "case_id", "condition", "repeat", "token_ids", "argmax", "logits_sha256",
                         "gold_nll"),
                rows=lambda p: _paths_cells(p) * len(_paths_spec(p)["dtypes"]) * 3 * p["paths_repeats"],
                not_null=("gold_nll", "logits_sha256")),
            "05_table17": Table(columns=("dtype", "output", "shared_pct", "reprefill_pct", "cross_pct", "excess_pp",
                                         "replay_pct", "cells"),
                                rows=lambda p: 3 * len(_paths_spec(p)["dtypes"]), not_null=("cross_pct",),
                                check=_table17_cpu),
            "05_table17_nll": Table(columns=("dtype", "nll_within", "nll_cross", "nll_excess", "cells"),
                                    rows=lambda p: len(_paths_spec(p)["dtypes"]), not_null=("nll_cross",)),
        },
    ),
    "08_evidence_location": Expected(
        figures=("08_cells",),
        tables={
            "08_panel": Table(columns=("dataset", "examined", "feasible", "excluded"),
                              rows=lambda p: len(_evidence_params(p)["datasets"]), not_null=("feasible",)),
            "08_records": Table(
                columns=("case_id", "method", "budget_pct", "side", "tail", "em", "gold_nll", "gold_margin",
                         "jsd_reprefill", "argmax_agree", "logits_identical", "logits_digest", "sequence_agree",
                         "allowance", "slot_width"),
                rows=lambda p: _evidence_cells(p) * _evidence_methods(p),
                not_null=("gold_nll", "gold_margin", "jsd_reprefill", "tv_reprefill", "logits_digest"),
                check=_evidence_records),
            "08_cell_means": Table(columns=("condition", "side", "tail", "em", "gold_nll", "sequence_agree"),
                                   rows=lambda p: 4 * _evidence_methods(p), not_null=("gold_nll",)),
            "08_table15": Table(columns=("condition", "hypothesis", "estimate", "ci_low", "ci_high", "p", "p_adj",
                                         "n", "n_clusters", "delta", "delta_low", "delta_high", "unit"),
                                rows=lambda p: 2 * 6, check=_evidence_table15),
            "08_table16": Table(columns=("endpoint", "condition", "estimate", "ci_low", "ci_high", "n", "n_clusters",
                                         "delta", "delta_low", "delta_high", "delta_mde", "unit"),
                                rows=lambda p: 2 * 5, not_null=("estimate", "delta")),
            "08_findings": Table(columns=("finding", "rule", "verdict", "evidence", "reproduced"), rows=lambda p: 3,
                                 check=_evidence_findings),
            # the preregistered primary decided: what the results index's sizes table reads its verdict from
            "08_decided": Table(columns=DECIDED, rows=lambda p: 1, not_null=("a", "b", "verdict"), check=_decided),
        },
    ),
    "06_noprefix_reuse": Expected(
        figures=("06_noprefix_local_vs_suffix", "06_noprefix_position_sweep", "06_noprefix_pareto_ttfl",
                 "06_noprefix_robustness"),
        tables={
            "06_noprefix_runs": Table(columns=("workload", "label", "protocol", "preserved", "repair_ratio"),
                                      not_null=("preserved", "repair_ratio")),
            "06_noprefix_drift": Table(columns=("workload", "requests", "mean_drift", "spearman_rho"),
                                       rows=_noprefix_workloads, not_null=("mean_drift",)),
            "06_noprefix_endpoints": Table(
                columns=("workload", "label", "protocol", "n", "preservation", "ci_low", "ci_high", "token_exact",
                         "gold_em", "changed_wrong", "repair_ratio", "timed", "ttfl_ms", "ttfl_p95_ms", "full_ttfl_ms",
                         "full_ttfl_p95_ms", "speedup"),
                rows=_noprefix_rows, not_null=("preservation", "ci_low", "ci_high", "repair_ratio"),
                check=lambda df, p: (_full_prefill_preserves_itself(df, p), _noprefix_endpoints(df, p))),
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
            "06_noprefix_sweep_runs": Table(columns=("slot", "label", "protocol", "preserved")),
            "06_noprefix_position_sweep": Table(
                columns=("slot", "label", "protocol", "preservation"),
                # every slot of the gold block x (prefix composition, oracle Doc K2, oracle Suffix K1) x protocols
                rows=lambda p: (study_params("noprefix", p)["sweep_docs"] - 1) * 3
                * len(study_params("noprefix", p)["protocols"]),
                not_null=("preservation",)),
            "06_noprefix_operating_rule": Table(columns=("workload", "serve", "label", "reason"),
                                                rows=_noprefix_workloads, check=_operating_rule),
            "06_noprefix_design_ledger": Table(columns=("experiment", "key_result", "verdict", "criterion"),
                                               rows=lambda p: 11, not_null=("key_result",), check=_noprefix_ledger),
            # the ledger's paired comparisons decided, the primary (donor-copy as a proxy) first: the claims table's
            # S10 and the sizes table read it
            "06_noprefix_decided": Table(columns=DECIDED, not_null=("a", "b", "verdict"), check=_decided),
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
            "07_agent_session_decided": Table(  # the conclusion's generated cell: what the claims table (B8) reads
                columns=DECIDED, rows=_agent_decided, not_null=("a", "b", "verdict"), check=_decided),
        },
        token_views=1,
    ),
    "09_stale_facts": Expected(
        figures=("09_summary",),
        tables={
            "09_roster": Table(columns=("case_id", "family", "asks_edited_key", "num_tokens", "inserted_len", "S"),
                               rows=lambda p: _stale_params(p)["num_cases"], not_null=("family", "num_tokens")),
            "09_records": Table(
                columns=("case_id", "family", "method", "budget_pct", "answer", "answer_class", "em", "stale",
                         "gold_margin", "old_margin", "margin_recovery", "cache_len", "note_tokens", "note_template",
                         "allowance"),
                rows=_stale_records, not_null=("answer_class", "gold_margin", "old_margin", "cache_len"),
                check=_stale_records_check),
            "09_summary": Table(
                columns=("method", "budget_pct", "em_pct", "stale_pct", "agree_pct", "margin_recovery",
                         "margin_recovery_median", "n_margin_defined", "forward_tokens"),
                rows=lambda p: len(_stale_params(p)["references"])
                + len(_stale_params(p)["allocators"]) * len(_stale_params(p)["budgets"])
                + (2 if _stale_late_cases(p) else 0),
                not_null=("em_pct", "agree_pct")),
            "09_paired_differences": Table(
                columns=(*DECIDED, "metric", "budget_pct", "delta", "delta_low", "delta_high", "delta_mde", "unit"),
                rows=_stale_pairs, not_null=("a", "b", "verdict"), check=_decided),
            "09_stale_rates": Table(columns=("family", "arm", "k", "n", "rate", "ci_low", "ci_high", "claim"),
                                    not_null=("family", "arm", "k", "n", "claim")),
            "09_old_margin": Table(columns=("family", "a", "b", "mean_a", "mean_b", "delta", "unit", "n"),
                                   not_null=("family", "a", "b", "delta")),
            "09_em_by_family": Table(columns=("arm",)),
            "09_margin_recovery_by_answer_in": Table(columns=("arm",)),
            "09_margin_differences": Table(
                columns=("answer_in", "budget_pct", "a", "b", "delta", "delta_low", "delta_high", "unit", "n"),
                not_null=("a", "b", "delta")),
        },
    ),
    "10_agent_traces": Expected(
        figures=("10_agent_traces_cost_agreement", "10_agent_traces_regions", "10_agent_traces_kinds"),
        tables={
            "10_agent_traces_runs": Table(
                columns=("trace", "turn", "edits", "kind", "known", "path", "sync_path", "first_change", "region",
                         "recomputed", "ttft_ms", "prediction", "agree", "em", "cum_recomputed", "cost_ratio"),
                rows=lambda p: _trace_sizes(p)["n_traces"] * _trace_sizes(p)["turns"] * _trace_paths(p),
                not_null=("recomputed", "ttft_ms", "cum_ttft_ms", "cost_ratio"), check=_trace_runs),
            "10_agent_traces_per_turn": Table(columns=("path", "turn", "ttft_ms", "agree_pct", "cost_ratio"),
                                              rows=lambda p: _trace_sizes(p)["turns"] * _trace_paths(p),
                                              not_null=("ttft_ms", "agree_pct")),
            "10_agent_traces_regions": Table(columns=("region", "path", "turns", "ttft_ms", "speedup", "agree_pct",
                                                      "agree_delta", "losses", "loss_upper_pct"),
                                             not_null=("ttft_ms", "speedup", "loss_upper_pct")),
            "10_agent_traces_kinds": Table(columns=("kind", "path", "turns", "known_pct", "agree_pct", "em_pct",
                                                    "agree_delta", "losses"),
                                           not_null=("agree_pct", "em_pct", "known_pct"), check=_trace_kinds),
            "10_agent_traces_summary": Table(
                columns=("path", "turns", "ttft_ms", "agree_pct", "em_pct", "cost_ratio", "time_ratio"),
                rows=_trace_paths, not_null=("agree_pct", "cost_ratio")),
            "10_agent_traces_decided": Table(columns=DECIDED, not_null=("a", "b", "verdict"), check=_decided),
        },
    ),
}
