"""Execution-path controls (appendix 11): Eq. 13 and the cross-path agreement on hand-made triples, the NLL analogue,
the per-cell and Table 17 summaries on synthetic records, the teacher-forced gold NLL against
``continuation_nll``, and a smoke run on SmolLM2 (slow)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from sur_lab.analysis.endpoints import gold_nll
from sur_lab.answer import continuation_nll
from sur_lab.edits import token_edit
from sur_lab.executors import reprefill
from sur_lab.studies.execution_paths import (
    CONDITIONS,
    OUTPUTS,
    a_cross,
    a_within,
    cell_table,
    nll_differences,
    nll_table,
    run,
    run_cell,
    table17,
    teacher_forced_logits,
)


def test_a_within_eq13_on_hand_made_triples():
    assert a_within(["a", "a", "a"]) == 1.0
    assert a_within(["a", "a", "b"]) == pytest.approx(1 / 3)
    assert a_within(["a", "b", "a"]) == pytest.approx(1 / 3)
    assert a_within(["a", "b", "c"]) == 0.0
    assert a_within([(1, 2), (1, 2), (1, 3)]) == pytest.approx(1 / 3)  # token-id sequences
    assert a_within([[1, 2], (1, 2)]) == 1.0
    assert a_within([7, 7]) == 1.0  # k = 2: one pair
    assert a_within(["a", "a", "b", "b"]) == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="values"):
        a_within(["a"])
    with pytest.raises(ValueError, match="values"):
        a_within("aaa")


def test_a_cross_over_nine_pairs():
    assert a_cross(["a", "a", "a"], ["a", "a", "b"]) == pytest.approx(6 / 9)
    assert a_cross(["a", "b", "c"], ["a", "b", "c"]) == pytest.approx(3 / 9)
    assert a_cross([1, 1, 1], [2, 2, 2]) == 0.0
    # Unclipped excess: cross-path agreement can exceed within agreement (negative excess).
    rp, rl = ["a", "b", "c"], ["a", "a", "a"]
    assert a_within(rp) - a_cross(rl, rp) == pytest.approx(0 - 3 / 9)
    with pytest.raises(ValueError, match="b_values"):
        a_cross(["a"], [])


def test_nll_differences():
    d = nll_differences([1.0, 1.0, 1.3], [1.5, 1.5, 1.5])
    # within: |0|, |0.3|, |0.3| -> median 0.3; cross: |0.5| x 6 and |0.2| x 3 -> median 0.5
    assert d == pytest.approx({"within": 0.3, "cross": 0.5, "excess": 0.2})
    same = nll_differences([2.0, 2.0, 2.0], [2.0, 2.0, 2.0])
    assert same == {"within": 0.0, "cross": 0.0, "excess": 0.0}
    with pytest.raises(ValueError, match="reprefill_nll"):
        nll_differences([1.0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        nll_differences([1.0, np.nan], [1.0])


def _records(cells: dict[str, dict[str, list]]) -> pd.DataFrame:
    rows = []
    for case_id, by in cells.items():
        for cond in CONDITIONS:
            for r, (seq, digest, top, nll) in enumerate(by[cond]):
                rows.append({"model": "m", "dtype": "float32", "device": "cpu", "case_id": case_id, "cell": "x",
                             "condition": cond, "repeat": r, "token_ids": seq, "logits_sha256": digest,
                             "argmax": top, "gold_nll": nll})
    return pd.DataFrame(rows)


def test_cell_table_and_table17_on_synthetic_records():
    same = ([1, 2], "h0", 5, 1.0)
    cells = {
        # Deterministic paths: everything agrees within; Replay differs in its logit bytes and once in its sequence.
        "c1": {"shared": [same] * 3, "reprefill": [same] * 3,
               "replay": [([1, 2], "h1", 5, 1.2), ([1, 2], "h1", 5, 1.2), ([1, 3], "h1", 5, 1.2)]},
        # One noisy Re-prefill repeat.
        "c2": {"shared": [same] * 3, "reprefill": [same, same, ([9], "h2", 6, 1.6)],
               "replay": [same] * 3},
    }
    ct = cell_table(_records(cells)).set_index("case_id")
    assert ct.loc["c1", "within_reprefill_sequence"] == 1.0
    assert ct.loc["c1", "cross_sequence"] == pytest.approx(6 / 9)
    assert ct.loc["c1", "cross_exact_logits"] == 0.0 and ct.loc["c1", "cross_argmax"] == 1.0
    assert ct.loc["c1", "excess_exact_logits"] == 1.0
    assert ct.loc["c2", "within_reprefill_argmax"] == pytest.approx(1 / 3)
    assert ct.loc["c2", "cross_argmax"] == pytest.approx(6 / 9)
    assert ct.loc["c2", "excess_argmax"] == pytest.approx(1 / 3 - 6 / 9)  # unclipped
    assert ct.loc["c1", "nll_within"] == 0.0 and ct.loc["c1", "nll_cross"] == pytest.approx(0.2)
    assert ct.loc["c2", "nll_within"] == pytest.approx(0.6) and ct.loc["c2", "nll_cross"] == 0.0
    t17 = table17(ct.reset_index()).set_index("output")
    assert list(t17.index) == list(OUTPUTS)
    assert t17.loc["exact_logits", "shared_pct"] == 0.0
    assert t17.loc["exact_logits", "cross_pct"] == pytest.approx(100 * (1 - (0 + 6 / 9) / 2))
    assert t17.loc["sequence", "reprefill_pct"] == pytest.approx(100 * (1 - (1 + 1 / 3) / 2))
    for row in t17.itertuples():
        assert row.excess_pp == pytest.approx(row.cross_pct - row.reprefill_pct)
    nt = nll_table(ct.reset_index()).iloc[0]
    assert nt["nll_within"] == pytest.approx(0.3) and nt["nll_cross"] == pytest.approx(0.1)
    assert nt["cells"] == 2
    with pytest.raises(ValueError, match="records"):
        cell_table(_records(cells).drop(columns="argmax"))
    with pytest.raises(ValueError, match="repeats"):
        recs = _records(cells)
        cell_table(recs[~((recs.condition == "replay") & (recs.repeat > 0))])


def test_teacher_forced_gold_nll_equals_continuation_nll(tiny_lm):
    g = torch.Generator().manual_seed(1)
    edit = token_edit(torch.randint(1, 90, (24,), generator=g), 5, 3, [7, 8, 9])
    cache = reprefill(tiny_lm, edit)
    ids = [11, 12, 13, 14]
    logits = teacher_forced_logits(tiny_lm, cache, edit, ids)
    assert logits.shape == (4, tiny_lm.spec.vocab_size)
    total = continuation_nll(tiny_lm, cache, edit, ids)
    assert gold_nll(logits, ids) * 4 == pytest.approx(total, rel=1e-12)
    assert teacher_forced_logits(tiny_lm, cache, edit, ids).equal(logits)  # the cache was not modified


def test_run_cell_is_deterministic_within_a_path_on_the_cpu(tiny_lm):
    g = torch.Generator().manual_seed(2)
    edit = token_edit(torch.randint(1, 90, (20,), generator=g), 4, 3, [7, 8])
    recs = pd.DataFrame(run_cell(tiny_lm, edit, [5, 6], repeats=3, max_new_tokens=3))
    assert len(recs) == 9 and list(recs.condition.unique()) == list(CONDITIONS)
    for cond, grp in recs.groupby("condition"):
        assert grp.logits_sha256.nunique() == 1 and grp.gold_nll.nunique() == 1  # same shapes, same kernels
        assert len({tuple(t) for t in grp.token_ids}) == 1
    with pytest.raises(ValueError, match="repeats"):
        run_cell(tiny_lm, edit, [5], repeats=1)
    with pytest.raises(ValueError, match="answer_ids"):
        run_cell(tiny_lm, edit, [])


@pytest.mark.slow
def test_smoke_run_on_smollm2(smol):
    from sur_lab.studies.evidence_location import build_panel

    panel = build_panel(smol.tokenizer, ["hotpotqa"], geometries="quarter", sources_per_dataset=1)
    recs = run(smol, panel.cases[1:2], repeats=3, max_new_tokens=2)  # downstream/short: the shortest cells
    assert len(recs) == 9 and set(recs["cell"]) == {"downstream/short"}
    cells = cell_table(recs)
    t17 = table17(cells)
    assert len(t17) == 3 and (t17["cells"] == 1).all()
    # Deterministic CPU kernels: repeated computations of the same shape agree exactly.
    assert (t17["shared_pct"] == 0).all() and (t17["reprefill_pct"] == 0).all() and (t17["replay_pct"] == 0).all()
    assert (nll_table(cells)["nll_within"] == 0).all()
    assert np.isfinite(recs["gold_nll"]).all() and (recs["gold_nll"] > 0).all()


def test_run_stores_cells_and_resumes_through_the_sweep_store(tiny_lm, tmp_path, monkeypatch):
    """With ``out`` the rows are keyed rows of the one sweep store: a stopped run keeps its finished cells, the next
    call computes only the missing ones and returns the rows an unstored run gives; another ``max_new_tokens`` is
    refused."""
    from types import SimpleNamespace

    import sur_lab.studies.execution_paths as ep

    g = torch.Generator().manual_seed(3)
    cases = [SimpleNamespace(case_id=f"hotpotqa/{i}/cell", meta={"dataset": "hotpotqa", "source_id": str(i)},
                             edit=token_edit(torch.randint(1, 90, (16,), generator=g), 3, 2, [7, 8]),
                             answer_ids=[5, 6]) for i in range(2)]
    plain = run(tiny_lm, cases, repeats=2, max_new_tokens=2)
    real, calls = ep.run_cell, []

    def stopped(lm, edit, *args, **kwargs):
        calls.append(edit)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(lm, edit, *args, **kwargs)

    monkeypatch.setattr(ep, "run_cell", stopped)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_lm, cases, repeats=2, max_new_tokens=2, out=tmp_path)
    stored = run(tiny_lm, cases, repeats=2, max_new_tokens=2, out=tmp_path)
    assert len(calls) == 3  # the first cell read back
    pd.testing.assert_frame_equal(stored, plain)
    pd.testing.assert_frame_equal(stored, pd.read_parquet(tmp_path / ep.TABLE_FILE))
    with pytest.raises(ValueError, match="another max_new_tokens"):
        run(tiny_lm, cases, repeats=2, max_new_tokens=3, out=tmp_path)
    with pytest.raises(ValueError, match="unique case ids"):
        run(tiny_lm, [cases[0], cases[0]], repeats=2)
