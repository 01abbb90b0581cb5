"""The embedded SmolLM2-135M-Instruct on one real HotpotQA context (slow: loads the model)."""

from __future__ import annotations

import pytest

from sur_lab.answer import answer
from sur_lab.cache_ops import layer_kv
from sur_lab.studies.datasets import load_qa
from sur_lab.studies.quickstart import quickstart_edit
from sur_lab.repair import prepare, repair

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_case(smol, data_dir):
    example = next(ex for ex in load_qa("hotpotqa") if ex.distractors and len(ex.supporting) >= 2)
    edit = quickstart_edit(smol.tokenizer, example)
    return smol, edit, prepare(smol, edit)


def test_embedded_model_spec(smol):
    s = smol.spec
    assert (s.model_type, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == ("llama", 30, 9, 3, 64)
    assert s.rope_theta == 1e5


def test_shift_leaves_stale_states_on_real_text(real_case):
    lm, edit, prep = real_case
    replayed = repair(lm, prep, "Replay").cache
    last = lm.spec.num_layers - 1
    k_s, v_s = layer_kv(prep.shift_cache, last)
    k_r, v_r = layer_kv(replayed, last)
    rows = edit.suffix_slice
    # The floor is the dense references' own disagreement: Replay and Re-prefill reach the same history by different
    # fp32 execution paths (appendix 11). Staleness must stand far above it.
    k_p, v_p = layer_kv(repair(lm, prep, "Re-prefill").cache, last)
    rel = lambda a, b: ((a[:, :, rows] - b[:, :, rows]).norm() / b[:, :, rows].norm()).item()  # noqa: E731
    assert rel(k_s, k_r) > 100 * max(rel(k_p, k_r), 1e-7)
    assert rel(v_s, v_r) > 100 * max(rel(v_p, v_r), 1e-7)


def test_sur_at_full_budget_reproduces_replay_answer(real_case):
    lm, edit, prep = real_case
    full = repair(lm, prep, "SUR", 100)
    assert full.allowance == edit.suffix_len
    a_sur = answer(lm, full.cache, edit, max_new_tokens=16)
    a_replay = answer(lm, repair(lm, prep, "Replay").cache, edit, max_new_tokens=16)
    assert a_sur.token_ids == a_replay.token_ids
