"""The one Algorithm 1 dispatcher (sur_lab.repair.repair): its path rule, its reference-operator registry, and the
callers that go through it (EditSession edits, the sweep's run_case)."""

from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest
import torch
from conftest import make_tiny_model

from sur_lab import EditSession, SyncPolicy, token_edit
from sur_lab.budget import allowance
from sur_lab.cache_ops import caches_equal
from sur_lab.executors import reprefill
from sur_lab.repair import (
    REFERENCE_METHODS,
    REFERENCE_OPERATORS,
    PreparedEdit,
    RepairResult,
    algorithm1_path,
    prepare,
    reference_operator,
    repair,
)


# sur_lab's __init__ re-exports the functions repair and session's names, which shadow the submodules as attributes.
repair_mod = importlib.import_module("sur_lab.repair")
# The session's live cache (sur_lab.live_cache.LiveCache) is the one caller of the dispatcher inside a session.
live_mod = importlib.import_module("sur_lab.live_cache")


@functools.cache
def tiny():
    return make_tiny_model("llama")


def _edit(seed: int = 0, n: int = 40, p: int = 6, d: int = 5):
    g = torch.Generator().manual_seed(seed)
    return token_edit(torch.randint(3, 96, (n,), generator=g), p, d, torch.randint(3, 96, (4,), generator=g))


@pytest.mark.parametrize("S, B, path", [(10, 10, "replay"), (10, 0, "shift"), (10, 3, "refresh"), (1, 1, "replay"),
                                        (0, 0, "shift")])
def test_algorithm1_path(S, B, path):
    assert algorithm1_path(S, B) == path


def test_algorithm1_path_refuses_an_allowance_outside_the_suffix():
    with pytest.raises(ValueError, match=r"allowance_=11 must lie in \[0, S=10\]"):
        algorithm1_path(10, 11)


def test_reference_methods_are_the_registered_operators_in_table_order():
    assert REFERENCE_METHODS == ("Dirty", "Shift", "Replay", "Re-prefill") == tuple(REFERENCE_OPERATORS)[:4]
    assert tuple(REFERENCE_OPERATORS)[4:] == ("Erratum",)
    with pytest.raises(ValueError, match="already registered"):
        reference_operator("Shift")(lambda *a, **k: None)


def test_a_new_reference_operator_is_one_registration(monkeypatch):
    """A reference operator registered by name is dispatched by repair() and run by run_case, with no other change."""
    from sur_lab.sweeps import Case, run_case

    calls = []

    def again(lm, prepared, *, inplace, options):
        calls.append(options.get("tag"))
        return RepairResult(reprefill(lm, prepared.edit), "Re-prefill again", float("nan"), None,
                            {"select": 0.0, "shift": 0.0, "refresh": 0.0}, prepared.edit.suffix_len)

    monkeypatch.setitem(REFERENCE_OPERATORS, "Re-prefill again", again)
    lm, edit = tiny(), _edit()
    result = repair(lm, prepare(lm, edit), "Re-prefill again", options={"tag": "x"})
    assert calls == ["x"] and caches_equal(result.cache, reprefill(lm, edit))
    records = run_case(lm, Case("c", edit), ("Re-prefill", "Re-prefill again"), (), max_new_tokens=3)
    assert [r.method for r in records] == ["Re-prefill", "Re-prefill again"]
    again_rec = records[1]
    assert np.isnan(again_rec.budget_pct) and again_rec.allowance == edit.suffix_len
    assert again_rec.answer == records[0].answer and again_rec.tv_reprefill == pytest.approx(0.0, abs=1e-12)


def test_dirty_needs_a_dirty_cache_and_replay_falls_back_to_the_shift_cache():
    lm, edit = tiny(), _edit()
    full = prepare(lm, edit)
    without = PreparedEdit(edit, None, full.shift_cache, 0.0, full.shift_ms)
    with pytest.raises(ValueError, match="prepared.dirty_cache is None"):
        repair(lm, without, "Dirty")
    # The Shift cache's prefix rows are the Dirty cache's, bitwise: Replay is the same either way.
    assert caches_equal(repair(lm, without, "Replay").cache, repair(lm, full, "Replay").cache)
    S = edit.suffix_len
    full_budget = repair(lm, without, "SUR", 100.0)
    assert full_budget.allowance == S and full_budget.support.size == S
    assert caches_equal(full_budget.cache, repair(lm, full, "Replay").cache)


@pytest.mark.parametrize("method, budget", [("SUR", 30.0), ("SUR", 0.0), ("SUR", 100.0), ("Replay", None),
                                            ("Re-prefill", None)])
def test_session_edits_go_through_the_dispatcher(monkeypatch, method, budget):
    seen = []

    def counting(lm, prepared, m, b=5.0, **kwargs):
        seen.append((m, b))
        return repair(lm, prepared, m, b, **kwargs)

    monkeypatch.setattr(live_mod, "repair", counting)
    lm = tiny()
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(3))
    session = EditSession(lm, method=method, budget_pct=budget if budget is not None else 5.0)
    session.append(ids)
    record = session.delete(10, 15)
    assert [m for m, _ in seen] == [method]
    S = 25
    expected_b = {"Replay": S, "Re-prefill": S}.get(method, allowance(S, budget or 0.0))
    assert record.allowance == expected_b
    if method != "Re-prefill" and expected_b:
        assert len(record.refreshed_rows) == expected_b


def test_shift_in_a_session_is_dispatched_without_a_clone(monkeypatch):
    """Shift goes through the one dispatcher like every method; the Shift cache handed over is the session's own
    working copy, so the reference operator takes it as it is (no clone of the live cache per edit)."""
    seen = []
    real = repair_mod.repair
    monkeypatch.setattr(live_mod, "repair", lambda lm, prepared, m, *a, **k: seen.append(m) or real(lm, prepared, m,
                                                                                                   *a, **k))
    monkeypatch.setattr(repair_mod, "clone_cache", lambda cache: pytest.fail("the Shift cache was cloned"))
    session = EditSession(tiny(), method="Shift")
    session.append(torch.arange(3, 43))
    assert session.delete(5, 9).allowance == 0 and seen == ["Shift"]
    assert session.sync(torch.cat((session.tokens[:3], session.tokens[6:])), policy=SyncPolicy(min_stale_rows=0)
                        ).allowance == 0
    assert seen == ["Shift", "Shift"]


def test_recover_and_repair_share_the_path_rule(monkeypatch):
    seen = []
    real = repair_mod.algorithm1_path
    monkeypatch.setattr(repair_mod, "algorithm1_path", lambda S, B: seen.append((S, B)) or real(S, B))
    lm, edit = tiny(), _edit()
    prepared = prepare(lm, edit)
    repair(lm, prepared, "SUR", 20.0)
    repair_mod.recover(lm, edit, prepared.dirty_cache, "SUR", 20.0, executor="sequential")
    S = edit.suffix_len
    assert seen == [(S, allowance(S, 20.0))] * 2


def test_reprefill_in_a_session_rebuilds_every_row_even_when_nothing_follows_the_edit():
    """Deleting the last rows leaves S = 0; Re-prefill still rebuilds the whole context (rows made stale by an earlier
    Shift-only edit included), as before the dispatcher was shared."""
    from sur_lab.forward import prefill

    session = EditSession(tiny(), method="Shift")
    session.append(torch.arange(3, 43))
    session.delete(5, 9)  # Shift only: the rows after 5 are stale
    assert session.debt > 0
    record = session.delete(30, 36, method="Re-prefill")  # nothing after the span: S = 0
    assert record.suffix_len == 0 and session.debt == 0 and len(record.refreshed_rows) == len(session)
    clean = prefill(tiny(), session.tokens)[0]
    assert caches_equal(session.cache, clean)
