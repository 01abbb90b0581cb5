"""Notebook 07's declared comparisons on hand-made episode rows (issue 36): the debt arm against its SUR arm alone,
per-edit SUR against Re-prefill within the declared margin, per-edit SUR against Shift with Holm, questions paired and
episodes clustered; a smoke run decides nothing."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from sur_lab.analysis.decisions import NOT_DECIDED, decides, paired_family
from sur_lab.runtime.run_notebooks import NOTEBOOK_DIR, smoke_parameters
from sur_lab.studies import agent_session as ags


def _rows(n_episodes: int, k: int, agree: dict) -> pd.DataFrame:
    rows = []
    for e in range(n_episodes):
        for i in range(1, k + 1):
            for arm in ("Shift", "SUR 5%", "SUR 5% + debt 10%", "Re-prefill"):
                rows.append({"episode": f"ep{e}", "edit": i, "arm": arm, "agree": agree[arm](e, i)})
    return pd.DataFrame(rows)


def test_declared_families_cluster_episodes():
    arms = ags.default_arms([5], debt_budget=5, debt_pct=10)
    # SUR agrees everywhere, Shift never: 10 episodes x 2 questions, all discordant, 10 clusters -> sign test 2/1024.
    df = _rows(10, 2, {"Shift": lambda e, i: False, "SUR 5%": lambda e, i: True,
                       "SUR 5% + debt 10%": lambda e, i: i == 1, "Re-prefill": lambda e, i: True})
    decided = ags.decide_families(df, arms, n_boot=200)
    assert list(decided.family) == [ags.PRIMARY.name, ags.REPREFILL_FAMILY.name, ags.BUDGET_FAMILY.name]
    primary, budget = decided.iloc[0], decided.iloc[2]
    assert (primary.a, primary.b) == ("SUR 5% + debt 10%", "SUR 5%") and primary.estimate == -0.5
    assert primary.n == 20 and primary.n_clusters == 10 and primary.p == pytest.approx(2 / 1024)
    assert primary.verdict == "loses to"
    assert budget.verdict == "beats" and budget.p == pytest.approx(2 / 1024)
    lines = ags.conclusion(decided)
    assert lines[1].startswith("  SUR 5% + debt 10% loses to SUR 5%: -50.0 pp (95 % CI")
    assert "20 questions in 10 episodes, 10 discordant" in lines[1]
    # One episode (the smoke size): nothing separates, and with decide=False nothing is decided.
    one = df[df.episode == "ep0"]
    assert (ags.decide_families(one, arms, n_boot=200).verdict == "not separated").all()
    assert (ags.decide_families(one, arms, n_boot=200, decide=False).verdict == "not decided").all()
    # No debt arm: no primary; SUR at its budget against Re-prefill and the budget family remain.
    assert list(ags.decide_families(df[df.arm != "SUR 5% + debt 10%"], ags.default_arms([5]), n_boot=200).family) \
        == [ags.REPREFILL_FAMILY.name, ags.BUDGET_FAMILY.name]


def test_lead_arm_is_sur_at_the_debt_arms_budget_else_5_else_the_first():
    assert ags.lead_arm(ags.default_arms([2, 5, 10], debt_budget=10, debt_pct=10)).label == "SUR 10%"
    assert ags.lead_arm(ags.default_arms([2, 5, 10], debt_budget=20, debt_pct=10)).label == "SUR 5%"
    assert ags.lead_arm(ags.default_arms([2, 5, 10])).label == "SUR 5%"
    assert ags.lead_arm(ags.default_arms([10, 2])).label == "SUR 10%"
    assert ags.lead_arm([ags.Arm("Shift", "Shift"), ags.Arm(ags.REFERENCE, ags.REFERENCE)]) is None


def _lost(lost: set) -> pd.DataFrame:
    """12 episodes of 10 edits; every arm agrees with Re-prefill except SUR 5 % on the ``(episode, edit)`` in
    ``lost``."""
    return _rows(12, 10, {"Shift": lambda e, i: True, "SUR 5%": lambda e, i: (e, i) not in lost,
                          "SUR 5% + debt 10%": lambda e, i: True, "Re-prefill": lambda e, i: True})


def test_sur_against_reprefill_is_equivalent_only_within_the_declared_margin():
    """The declared margin is issue 27's tolerance (5 points, as notebook 10's); 120 questions in 12 episodes:
    1 answer lost is equivalent (the 90 % interval inside ±5 points), 3 lost straddle the margin (not separated),
    12 lost (one per episode) are beyond it (shown to lose, the whole interval below -5 points)."""
    assert ags.AGREEMENT_MARGIN.value == ags.MAX_AGREEMENT_LOSS == 0.05
    assert ags.AGREEMENT_MARGIN.source.startswith("issue 27's tolerance: at most 5 points of agreement lost")
    assert ags.REPREFILL_FAMILY.margin == ags.AGREEMENT_MARGIN and not ags.REPREFILL_FAMILY.primary
    arms = ags.default_arms([5], debt_budget=5, debt_pct=10)
    clusters = np.repeat([f"ep{e}" for e in range(12)], 10)
    rows = {}
    for n_lost in (1, 3, 12):
        lost = {(e, 1) for e in range(n_lost)}
        decided = ags.decide_families(_lost(lost), arms, n_boot=1000, seed=0)
        got = decided[decided.family == ags.REPREFILL_FAMILY.name].reset_index(drop=True)
        sur = np.array([float((e, i) not in lost) for e in range(12) for i in range(1, 11)])
        want = paired_family({("SUR 5%", ags.REFERENCE): (sur, np.ones(120))}, family=ags.REPREFILL_FAMILY,
                             cluster=clusters, n_boot=1000, seed=0)  # paired_family itself, with the margin
        pd.testing.assert_frame_equal(got, want)
        rows[n_lost] = got.iloc[0]
    for n_lost, r in rows.items():
        assert (r.a, r.b, r.comparison) == ("SUR 5%", ags.REFERENCE, "SUR 5% vs Re-prefill")
        assert r.estimate == -n_lost / 120 and r.n == 120 and r.n_clusters == 12 and r.n_discordant == n_lost
        assert r.margin == 0.05 and r.margin_source == ags.AGREEMENT_MARGIN.source and r.family_size == 1
    one, three, twelve = rows[1], rows[3], rows[12]
    assert one.verdict == "equivalent" and -0.05 < one.tost_low < one.estimate < one.tost_high < 0.05
    assert one.p == 1.0  # one discordant episode: the exact sign test cannot separate
    assert three.verdict == "not separated" and three.tost_low < -0.05 < three.tost_high and three.p == 0.25
    assert twelve.verdict == "loses to" and twelve.tost_high < -0.05 and twelve.ci_high < 0
    assert twelve.p == pytest.approx(2 * 0.5 ** 12)  # all 12 episodes lose one answer each


def test_a_smoke_run_decides_nothing():
    """Notebook 07 passes ``decide=decides(preset)`` and its smoke parameters set ``preset="smoke"`` (the smoke sizes
    unchanged): every declared comparison, the equivalence included, is "not decided" on data that would decide."""
    path = NOTEBOOK_DIR / "07_agent_session.ipynb"
    smoke = smoke_parameters(path)
    assert smoke == {"budgets": [5], "k": 2, "max_doc_tokens": 12, "max_new_tokens": 4, "model_name": "",
                     "n_episodes": 1, "preset": "smoke"}
    code = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert "decide_families(runs, arms, decide=decides(preset), seed=seed)" in "".join(code[-1]["source"])
    arms = ags.default_arms([5], debt_budget=5, debt_pct=10)
    data = _lost({(e, 1) for e in range(12)})
    decided = ags.decide_families(data, arms, n_boot=200, decide=decides("default"))
    assert list(decided.verdict) == ["beats", "loses to", "loses to"]  # debt vs SUR, SUR vs Re-prefill, SUR vs Shift
    smoke_run = ags.decide_families(data, arms, n_boot=200, decide=decides(smoke["preset"]))
    assert len(smoke_run) == 3 and (smoke_run.verdict == NOT_DECIDED).all()


def test_run_episodes_stores_and_resumes_through_the_sweep_store(tmp_path, data_dir, monkeypatch):
    """With ``out`` each episode's rows are keyed rows of the one sweep store: a second call reads them back (nothing
    recomputed, the same table but the timings), and another seed is refused."""
    import dataclasses

    from conftest import make_tiny_model
    from test_allocators import char_tokenizer

    from sur_lab.data.qa import load_qa

    lm = dataclasses.replace(make_tiny_model("llama"), tokenizer=char_tokenizer())
    episodes = ags.build_episodes(lm.tokenizer, load_qa("hotpotqa", split="dev"), 2, 2, max_doc_tokens=10)
    arms = ags.default_arms([5])
    kw = dict(executor="sequential", max_new_tokens=2, progress=False)
    runs = ags.run_episodes(lm, episodes, arms, out=tmp_path, **kw)
    plain = ags.run_episodes(lm, episodes, arms, **kw)
    timings = ["refresh_ms", "select_ms", "answer_ms", "cum_refresh_ms"]
    pd.testing.assert_frame_equal(runs.drop(columns=timings), plain.drop(columns=timings))
    monkeypatch.setattr(ags, "run_episode", lambda *a, **k: pytest.fail("a stored episode was recomputed"))
    pd.testing.assert_frame_equal(ags.run_episodes(lm, episodes, arms, out=tmp_path, **kw), runs)
    with pytest.raises(ValueError, match="another seed"):
        ags.run_episodes(lm, episodes, arms, out=tmp_path, seed=1, **kw)
