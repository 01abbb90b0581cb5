"""The embedded SmolLM2-135M-Instruct on one real HotpotQA context (slow: loads the model)."""

from __future__ import annotations

import pytest
import torch

from sur_lab.answer import answer
from sur_lab.cache_ops import layer_kv
from sur_lab.data.qa import load_qa
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


def _hf_greedy(lm, ids, max_new_tokens):
    """Oracle: plain transformers prefill of ``ids`` and greedy decoding (no sur_lab code); ``(tokens, first logits)``."""
    from transformers import DynamicCache

    cache = DynamicCache()
    eos = set(lm.eos_token_ids)
    with torch.no_grad():
        logits = lm.model(input_ids=ids[None], cache=cache, use_cache=True).logits[0, -1].float()
        first, tokens = logits, []
        for _ in range(max_new_tokens):
            token = int(logits.argmax())
            if token in eos:
                break
            tokens.append(token)
            logits = lm.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1].float()
    return tuple(tokens), first


def test_sur_at_full_budget_reproduces_a_plain_prefill_answer(real_case):
    # The oracle is an independent transformers prefill of the edited prompt, not repair's own Replay.
    lm, edit, prep = real_case
    full = repair(lm, prep, "SUR", 100)
    assert full.allowance == edit.suffix_len
    a_sur = answer(lm, full.cache, edit, max_new_tokens=16)
    tokens, first = _hf_greedy(lm, torch.cat((edit.edited_ids, edit.query_ids)), 16)
    assert a_sur.token_ids == tokens
    # FP32 paths of different shapes: SUR's first logits may differ from the oracle's by about what Re-prefill's own
    # (a one-pass prefill of the same ids, split at the query) does, plus a float32 rounding floor.
    a_pre = answer(lm, repair(lm, prep, "Re-prefill").cache, edit, max_new_tokens=1)
    ref_err = (a_pre.first_token_logits - first).abs().max().item()
    floor = 64 * torch.finfo(torch.float32).eps * first.abs().max().item()
    assert (a_sur.first_token_logits - first).abs().max().item() <= 2 * ref_err + floor
