"""Issue 28's design evidence: the matched-token protocol as a sweep method (Table 14), the one-factor-at-a-time
ablation table, the dispatcher's exact allowance, and the cross-model assembly of NIAH folders (``niah.combine``).

SUR's variants against the frozen SUR, the controls against brute-force oracles and the allocator-level matched count
are in ``tests/test_allocator_variants.py``; these tests cover what the study builds on them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import make_tiny_model
from sur_lab.allocators import AllocationRequest, allocate
from sur_lab.budget import allowance, prompt_allowance
from sur_lab.edits import token_edit
from sur_lab.repair import prepare, repair
from sur_lab.studies import niah
from sur_lab.sweeps import Case, records_frame, run_case, run_sweep


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama")


def random_edit(seed: int, prefix: int, deleted: int, suffix: int, query: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (prefix + deleted + suffix,), generator=g)
    return token_edit(ids, prefix, deleted, torch.randint(0, 96, (query,), generator=g))


def _cases(n: int = 3) -> list[Case]:
    return [Case(f"c{i}", random_edit(10 + i, 30 + 4 * i, 3, 50 + 9 * i), gold=("x",),
                 meta={"context_len": 128, "dataset": "toy"}) for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------------
# The dispatcher's exact allowance


def test_repair_takes_an_exact_allowance_and_keeps_algorithm_1s_endpoints(llama):
    edit = random_edit(3, 40, 4, 57)
    S = edit.suffix_len
    for n in (1, 7, S - 1):
        out = repair(llama, prepare(llama, edit), "Dense tokens", 5, allowance=n)
        assert out.allowance == n and out.selection.support.size == n
    shift = repair(llama, prepare(llama, edit), "Dense tokens", 5, allowance=0)
    assert shift.allowance == 0 and shift.selection.support.size == 0 and shift.timings_ms["refresh"] == 0.0
    full = repair(llama, prepare(llama, edit), "Dense tokens", 5, allowance=S)
    assert full.allowance == S and full.selection.support.size == S
    only = repair(llama, prepare(llama, edit), "SUR", None, allowance=9)
    assert only.allowance == 9 and np.isnan(only.budget_pct)
    with pytest.raises(ValueError, match="allowance"):
        repair(llama, prepare(llama, edit), "SUR", 5, allowance=S + 1)


# ---------------------------------------------------------------------------------------------------------------------
# The matched-token protocol as a sweep method


@pytest.mark.parametrize("region", ["SUR", "SUR[allowance_base=prompt]", "SUR[aggregation=mean]"])
@pytest.mark.parametrize("token", ["Dense tokens", "ProphetKV-Adapted", "Cache-Craft-Adapted"])
def test_matched_tokens_selects_exactly_the_regions_count(llama, region, token):
    edit = random_edit(5, 70, 4, 48)
    prepared = prepare(llama, edit)
    n = allocate(region, AllocationRequest(llama, edit, 5)).support.size
    expected = (prompt_allowance(edit.suffix_len, edit.edited_len, 5) if "prompt" in region
                else allowance(edit.suffix_len, 5))
    assert n == expected
    method = niah.MatchedTokens(token, region, 5)
    out = method.repair(llama, prepared, executor="sequential", seed=0, options=None)
    assert out.allowance == n and out.selection.support.size == n
    assert method.name == f"{token} (matched to {region})"
    # The same positions as the token-level allocator given n directly: only the count is matched.
    direct = allocate(token, AllocationRequest(llama, edit, 5, shift_cache=prepared.shift_cache,
                                               options={"dirty_cache": prepared.dirty_cache}, allowance=n))
    assert out.selection.support.positions.tolist() == direct.support.positions.tolist()


def test_matched_tokens_refuses_bad_names_and_budgets():
    with pytest.raises(ValueError, match="unknown allocator"):
        niah.MatchedTokens("Nope", "SUR", 5)
    with pytest.raises(ValueError, match="must differ"):
        niah.MatchedTokens("SUR", "SUR", 5)
    with pytest.raises(ValueError, match="budget"):
        niah.MatchedTokens("Dense tokens", "SUR", 150)


def test_matched_sweep_records_and_table14(llama):
    region = "SUR[allowance_base=prompt]"  # a count that differs from the token allocator's own B
    methods = ["Re-prefill", region, *(niah.MatchedTokens("Dense tokens", region, b) for b in (2, 5))]
    records = []
    for case in _cases(3):
        records += run_case(llama, case, methods, [2, 5], max_new_tokens=2)
    df = records_frame(records)
    for b in (2.0, 5.0):
        reg = df[(df.method == region) & (df.budget_pct == b)].set_index("case_id")["allowance"]
        tok = df[(df.method == niah.matched_label("Dense tokens", region)) & (df.budget_pct == b)]
        assert tok.set_index("case_id")["allowance"].to_dict() == reg.to_dict()
        assert (tok["positions"].map(len) == tok["allowance"]).all()
    table = niah.table14(df, region=region, n_boot=200)
    assert table["budget_pct"].tolist() == [2.0, 5.0] and set(table["allocator"]) == {"Dense tokens"}
    for row in table.itertuples():
        at_b = df[df.budget_pct == row.budget_pct]
        reg = at_b[at_b.method == region]
        assert row.mean_tokens == pytest.approx(reg["allowance"].mean())
        tok = at_b[at_b.method == niah.matched_label("Dense tokens", region)]
        expect = 100 * (reg["agree_reprefill"].astype(float).mean() - tok["agree_reprefill"].astype(float).mean())
        assert row.agree_reprefill_diff_pp == pytest.approx(expect)
        assert row.agree_reprefill_ci_low_pp <= row.agree_reprefill_diff_pp <= row.agree_reprefill_ci_high_pp
        assert row.agree_reprefill_ci_low_pp < row.agree_reprefill_ci_high_pp  # never a zero-width interval
        assert row.em_verdict == "not separated"  # three cases cannot separate anything
    broken = df.copy()
    broken.loc[broken.method == niah.matched_label("Dense tokens", region), "allowance"] += 1
    with pytest.raises(ValueError, match="does not select"):
        niah.table14(broken, region=region)
    with pytest.raises(ValueError, match="no method matched"):
        niah.table14(df, region="SUR")


def test_matched_methods_and_presets():
    for preset in ("smoke", "default", "paper"):
        p = niah.params(preset)
        ms = niah.matched_methods(p)
        assert ms[:3] == ["Shift", "Re-prefill", "SUR"]
        assert len(ms) == 3 + len(p["matched_allocators"]) * len(p["matched_budgets"])
        assert all(m.region == "SUR" for m in ms[3:])
        # The ablation runs with the allocators, on the same cases, once each.
        names = niah.methods(p)
        assert len(names) == len(set(names)) and set(p["ablation"]) <= set(names)
    assert set(niah.PRESETS["paper"]["ablation"]) == set(niah.ABLATION)
    assert niah.HOLDOUT_SEED != 0 and niah.FIXED["holdout_seed"] == niah.HOLDOUT_SEED


# ---------------------------------------------------------------------------------------------------------------------
# The ablation table


def _ablation_records(sur, mean, blocks):
    rows = []
    for i, (a, b, c) in enumerate(zip(sur, mean, blocks)):
        case = {"case_id": f"c{i}", "context_len": 1024}
        for method, v, n in (("SUR", a, 10), ("SUR[aggregation=mean]", b, 10), ("Fixed blocks", c, 10),
                             ("SUR[allowance_base=prompt]", a, 14)):
            rows.append({**case, "method": method, "budget_pct": 5.0, "em": bool(v), "allowance": n,
                         "num_intervals": 2})
    return pd.DataFrame(rows)


def test_ablation_table_values():
    records = _ablation_records([1, 1, 0, 1, 0, 1], [0, 1, 0, 0, 0, 1], [1, 1, 1, 1, 0, 1])
    table = niah.ablation_table(records, n_boot=300).set_index("method")
    assert list(table.index) == ["SUR[aggregation=mean]", "SUR[allowance_base=prompt]", "Fixed blocks"]
    assert table.loc["SUR[aggregation=mean]", "diff_pp"] == pytest.approx(100 * (2 - 4) / 6)
    assert table.loc["SUR[aggregation=mean]", "factor"] == "aggregation"
    assert table.loc["Fixed blocks", "diff_pp"] == pytest.approx(100 * (5 - 4) / 6)
    assert table.loc["Fixed blocks", "factor"] == "boundaries"
    prompt = table.loc["SUR[allowance_base=prompt]"]
    assert prompt["diff_pp"] == 0.0 and prompt["mean_tokens"] == 14 and prompt["reference_tokens"] == 10
    assert prompt["verdict"] == "not separated" and prompt["ci_low_pp"] < 0 < prompt["ci_high_pp"]
    assert set(table["family"]) == {niah.ABLATION_FAMILY.name} and (table["family_size"] == 3).all()
    assert (niah.ablation_table(records, n_boot=300, decide=False)["verdict"] == "not decided").all()
    with pytest.raises(ValueError, match="metric='nope'"):
        niah.ablation_table(records, metric="nope")
    with pytest.raises(ValueError, match="reference='BM25'"):
        niah.ablation_table(records, reference="BM25")


# ---------------------------------------------------------------------------------------------------------------------
# Cross-model assembly


def _folder(lm, path, cases, **kwargs):
    run_sweep(lm, cases, ["Shift", "Re-prefill", "SUR", "Dense tokens"], [5, 20], path, progress=False, **kwargs)
    return path


def test_combine_stacks_models_and_refuses_other_differences(tmp_path):
    llama, qwen = make_tiny_model("llama"), make_tiny_model("qwen3", seed=1)
    cases = _cases(2)
    a = _folder(llama, tmp_path / "a", cases, max_new_tokens=2)
    b = _folder(qwen, tmp_path / "b", cases, max_new_tokens=2)
    combined = niah.combine([a, b])
    assert list(dict.fromkeys(combined["model"])) == ["tiny-llama", "tiny-qwen3"]
    assert len(combined) == 2 * 2 * (2 + 2 * 2)
    stacked = niah.stacked_budget_tables(combined, "agree_reprefill")
    assert list(stacked.index.get_level_values("model").unique()) == ["tiny-llama", "tiny-qwen3"]
    assert stacked.loc[("tiny-qwen3", "Re-prefill"), "Reference"] == 100.0
    fig = niah.plot_model_panels(combined, "agree_reprefill")
    assert len(fig.axes) == 2
    # Another decoding limit: not only the model differs.
    c = _folder(qwen, tmp_path / "c", cases, max_new_tokens=3)
    with pytest.raises(ValueError, match="'max_new_tokens' differs"):
        niah.combine([a, c])
    # Another seed, another roster, the same model twice, a repeated folder.
    d = _folder(qwen, tmp_path / "d", cases, max_new_tokens=2, seed=1)
    with pytest.raises(ValueError, match="'seed' differs"):
        niah.combine([a, d])
    e = _folder(qwen, tmp_path / "e", cases[:1], max_new_tokens=2)
    with pytest.raises(ValueError, match="different cases"):
        niah.combine([a, e])
    with pytest.raises(ValueError, match="same model"):
        niah.combine([b, e])
    with pytest.raises(ValueError, match="repeat"):
        niah.combine([a, a])
    with pytest.raises(ValueError, match="empty"):
        niah.combine([])
    with pytest.raises(FileNotFoundError):
        niah.combine([a, tmp_path / "missing"])
