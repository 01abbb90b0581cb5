"""Notebook 07's declared comparisons on hand-made episode rows (issue 36): the debt arm against its SUR arm alone,
per-edit SUR against Shift with Holm, questions paired and episodes clustered."""

from __future__ import annotations

import pandas as pd
import pytest

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
    assert list(decided.family) == [ags.PRIMARY.name, ags.BUDGET_FAMILY.name]
    primary, budget = decided.iloc[0], decided.iloc[1]
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
    # No debt arm: only the budget family.
    assert list(ags.decide_families(df[df.arm != "SUR 5% + debt 10%"], ags.default_arms([5]), n_boot=200).family) \
        == [ags.BUDGET_FAMILY.name]


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
