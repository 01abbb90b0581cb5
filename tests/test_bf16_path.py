"""The bfloat16 study path (issue 37): ``dtype="auto"`` and its reason, the LM head's row-major input, and bfloat16
correctness forced on any CPU (with or without native bf16: these tests check values, never speed).

Tolerances come from bfloat16's unit roundoff u = 2^-8 and from a same-dtype reference's own error (the style of
flash-attention's tests): a bf16 repair is compared with the float64 computation of the same weights (the bf16
weights widened exactly), and must stay within twice the error of the sequential bf16 reference plus u times the
oracle's scale. The "auto" choice is tested by mocking the capability probe (:func:`sur_lab.models.native_bf16_flags`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
from conftest import QWEN_TOKENIZER_DIR, enable_float64_norm, make_tiny_model

import sur_lab.models as models
from sur_lab.budget import Support
from sur_lab.cache_ops import to_tensors
from sur_lab.edits import token_edit
from sur_lab.executors import get_executor
from sur_lab.fingerprint import dtype_line, dtype_reason
from sur_lab.forward import forward_tokens, prefill
from sur_lab.models import enable_float64_rope, resolve_dtype, wrap_model
from sur_lab.repair import prepare, repair

#: bfloat16's unit roundoff: 8 significand bits, u = 2^-8.
BF16_U = 2.0**-8

X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse sse2 avx avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile
"""
ARM_CPUINFO = """processor\t: 0
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 bf16 i8mm
"""


# ---------------------------------------------------------------------------------------------------- dtype="auto"


@pytest.mark.parametrize(("text", "expected"), [(X86_CPUINFO, ("avx512_bf16", "amx_bf16")),
                                                (ARM_CPUINFO, ("bf16",)),
                                                ("flags\t: fpu sse avx2 avx512f\n", ())])
def test_native_bf16_flags_read_the_cpuinfo_lines(text, expected, monkeypatch):
    monkeypatch.setattr(models.Path, "read_text", lambda self, **kw: text)
    assert models.native_bf16_flags() == expected


def test_cpu_flags_without_a_cpuinfo_file_are_empty(monkeypatch):
    def missing(self, **kw):
        raise FileNotFoundError(self)

    monkeypatch.setattr(models.Path, "read_text", missing)
    assert models.cpu_flags() == frozenset() and models.native_bf16_flags() == ()


def test_auto_picks_bfloat16_where_the_cpu_computes_it_once_parity_holds(monkeypatch):
    monkeypatch.setattr(models, "native_bf16_flags", lambda: ("avx512_bf16",))
    dtype, reason = resolve_dtype("auto")  # the parity study kept float32 (AUTO_CPU_BFLOAT16 is False)
    assert dtype == torch.float32 and "docs/bf16.md" in reason and "avx512_bf16" in reason
    monkeypatch.setattr(models, "AUTO_CPU_BFLOAT16", True)  # a parity study that held
    dtype, reason = resolve_dtype("auto")
    assert dtype == torch.bfloat16 and reason.startswith("auto:") and "avx512_bf16" in reason


def test_auto_picks_float32_on_a_cpu_without_native_bf16(monkeypatch):
    monkeypatch.setattr(models, "native_bf16_flags", lambda: ())
    dtype, reason = resolve_dtype("auto", "cpu")
    assert dtype == torch.float32 and "no native bfloat16" in reason


def test_auto_picks_bfloat16_on_cuda_and_explicit_dtypes_are_requested(monkeypatch):
    monkeypatch.setattr(models, "native_bf16_flags", lambda: ())
    assert resolve_dtype("auto", "cuda")[0] == torch.bfloat16
    assert resolve_dtype("auto", "meta")[0] == torch.float32
    assert resolve_dtype("bf16") == (torch.bfloat16, "requested")
    assert resolve_dtype(torch.float64) == (torch.float64, "requested")
    assert models.check_dtype_arg("auto") == "auto" and models.check_dtype_arg("fp32") == torch.float32
    for bad, match in (("Auto", "did you mean 'auto'"), ("int8", "'auto'"), (torch.int32, "floating")):
        with pytest.raises(ValueError, match=match):
            resolve_dtype(bad)
    with pytest.raises(ValueError, match="device"):
        resolve_dtype("auto", "gpu0")


def test_load_model_auto_loads_the_chosen_dtype_and_says_why(tmp_path, monkeypatch):
    """A tiny Qwen2 saved with the Qwen2.5 tokenizer, loaded with dtype="auto" (the probe mocked both ways)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    if not (QWEN_TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip(f"Qwen2.5 tokenizer files not found at {QWEN_TOKENIZER_DIR}")
    tokenizer = AutoTokenizer.from_pretrained(QWEN_TOKENIZER_DIR)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         use_sliding_window=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr(models, "AUTO_CPU_BFLOAT16", True)
    for flags, dtype in ((("amx_bf16",), torch.bfloat16), ((), torch.float32)):
        monkeypatch.setattr(models, "native_bf16_flags", lambda flags=flags: flags)
        lm = models.load_model(str(tmp_path), dtype="auto")
        assert lm.dtype == dtype and lm.spec.dtype == dtype
        assert dtype_reason(lm) == resolve_dtype("auto")[1]
        name = str(dtype).removeprefix("torch.")
        line = dtype_line(lm)
        assert line.startswith(name + " (auto: ") and not line.startswith(f"{name} (auto: {name}")  # named once
    assert dtype_reason(models.load_model(str(tmp_path), dtype="bfloat16")) == "requested"


# ------------------------------------------------------------------------------------- the LM head's input layout


def test_the_lm_head_gets_a_row_major_input(tiny_lm):
    """A kept last position arrives as a strided view; the hook hands the head a row-major copy with the same
    values, so the logits equal the head applied to that row (bitwise: the same GEMM on the same row)."""
    seen = []
    head = tiny_lm.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    try:
        ids = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(0))
        cache, last = prefill(tiny_lm, ids)
    finally:
        handle.remove()
    (x,) = seen
    assert x.shape == (1, 1, tiny_lm.spec.hidden_size) and x.stride() == (x.shape[1] * x.shape[2], x.shape[2], 1)
    assert torch.equal(head(x)[0, -1].float(), last)
    assert getattr(head, "_sur_lab_row_major_input", False)
    models.contiguous_head_input(tiny_lm.model)  # idempotent: one hook
    assert len(head._forward_pre_hooks) == 1


# ------------------------------------------------------------------------------------------- bfloat16 correctness


def _bf16_pair(kind: str):
    """A tiny bf16 model and the float64 model of exactly its weights (widening bf16 is exact)."""
    lm16 = make_tiny_model(kind, dtype=torch.bfloat16, head_dim=64, hidden=64, layers=2)
    model64 = copy.deepcopy(lm16.model).to(torch.float64)
    enable_float64_rope(model64)
    enable_float64_norm(model64)
    return lm16, wrap_model(model64, None, f"tiny-{kind}-fp64")


def _edit():
    g = torch.Generator().manual_seed(4)
    return token_edit(torch.randint(0, 96, (150,), generator=g), 7, 4, torch.randint(0, 96, (5,), generator=g))


def _err(cache, oracle, rows):
    return max(max((k[:, :, rows].double() - ko[:, :, rows]).abs().max().item(),
                   (v[:, :, rows].double() - vo[:, :, rows]).abs().max().item())
               for (k, v), (ko, vo) in zip(to_tensors(cache), to_tensors(oracle)))


def _scale(cache, rows):
    return max(max(k[:, :, rows].abs().max().item(), v[:, :, rows].abs().max().item()) for k, v in to_tensors(cache))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_bf16_packed_refresh_is_within_the_sequential_references_error(kind):
    """The packed executor's bfloat16 path (the one-pass kernel where it is built, the key split otherwise) against
    the float64 refresh of the same weights: within twice the bf16 sequential reference's own error plus one
    bf16 rounding of the oracle's scale (u = 2^-8). Both start from the same bf16 Shift cache."""
    lm16, lm64 = _bf16_pair(kind)
    edit = _edit()
    support = Support(np.r_[0:5, 40:41, 70:90, edit.suffix_len - 2 : edit.suffix_len], edit.suffix_len)
    rows = torch.as_tensor(support.absolute(edit.prefix_len))
    shift16 = prepare(lm16, edit).shift_cache
    shift64 = prepare(lm64, edit).shift_cache
    oracle = get_executor("sequential")(lm64, shift64, edit, support)
    seq_err = _err(get_executor("sequential")(lm16, shift16, edit, support), oracle, rows)
    floor = BF16_U * _scale(oracle, rows)
    for name in ("packed", "packed-cpp"):
        out = get_executor(name)(lm16, shift16, edit, support)
        assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in to_tensors(out))  # never up-cast
        assert _err(out, oracle, rows) <= 2 * seq_err + floor, name
    assert seq_err > 0  # bf16 really rounds: the bound is not vacuous


def test_bf16_references_keep_their_dtype_and_stay_within_the_rounding_of_float64():
    """Dirty, Shift, Replay, Re-prefill (shared and not) and a packed SUR repair of a bf16 model: every cache stays
    bfloat16 (no whole cache is up-cast), Shift's re-rotated keys are one bf16 rounding of the float64 rotation of the
    same bf16 keys, and Re-prefill's rows lie within the bf16 Replay's own error (+ u x scale) of the float64
    rebuild."""
    from sur_lab.cache_ops import rerotate_keys

    lm16, lm64 = _bf16_pair("llama")
    edit = _edit()
    p, d = edit.prefix_len, edit.deleted_len
    prepared = prepare(lm16, edit)
    for k, v in to_tensors(prepared.dirty_cache) + to_tensors(prepared.shift_cache):
        assert k.dtype == v.dtype == torch.bfloat16
    for (ks, _), (kd, _) in zip(to_tensors(prepared.shift_cache), to_tensors(prepared.dirty_cache)):
        exact = rerotate_keys(kd[:, :, p + d :].double(), -d, lm16.inv_freq)  # the same bf16 keys in float64
        # One bf16 rounding of the result (u |exact|), plus the float32 rotation's own few ulps of the inputs.
        allowed = BF16_U * exact.abs() + 4 * torch.finfo(torch.float32).eps * kd.abs().max().item()
        assert ((ks[:, :, p:].double() - exact).abs() <= allowed).all()
    oracle = repair(lm64, prepare(lm64, edit), "Re-prefill").cache
    rows = slice(None)
    replay_err = _err(repair(lm16, prepared, "Replay").cache, oracle, rows)
    for share in (False, True):
        prepared.share_prefix = share
        for method, budget in (("Re-prefill", 0), ("Replay", 0), ("SUR", 20)):
            cache = repair(lm16, prepared, method, budget, executor="packed").cache
            assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in to_tensors(cache)), (method, share)
        reprefilled = repair(lm16, prepared, "Re-prefill").cache
        assert _err(reprefilled, oracle, rows) <= 2 * replay_err + BF16_U * _scale(oracle, rows), share


def test_a_kernel_without_the_dtype_warns_once_and_falls_back(monkeypatch):
    """Where the one-pass kernel has no bf16 path it says so once and packed attention runs the key split in bf16:
    the same result as packed-sdpa-split, the cache still bfloat16."""
    from sur_lab.executors import packed
    from sur_lab.executors.kernels import onepass

    lm16, _ = _bf16_pair("llama")
    edit = _edit()
    support = Support(np.r_[0:5, 70:90], edit.suffix_len)
    shift16 = prepare(lm16, edit).shift_cache
    monkeypatch.setattr(onepass, "ONEPASS_DTYPES", (torch.float32, torch.float64))
    monkeypatch.setattr(packed, "_KERNEL_DTYPE_WARNED", set())
    with pytest.warns(RuntimeWarning, match="no bfloat16 path"):
        out = get_executor("packed-cpp")(lm16, shift16, edit, support)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process and dtype
        again = get_executor("packed-cpp")(lm16, shift16, edit, support)
    split = get_executor("packed-sdpa-split")(lm16, shift16, edit, support)
    for (k, v), (k2, v2), (k3, v3) in zip(to_tensors(out), to_tensors(again), to_tensors(split)):
        assert k.dtype == torch.bfloat16 and torch.equal(k, k3) and torch.equal(v, v3)
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_records_carry_the_dtype_and_its_reason(monkeypatch):
    from test_allocators import char_tokenizer

    from sur_lab.sweeps import Case, run_case

    lm16, _ = _bf16_pair("llama")
    lm16 = dataclasses.replace(lm16, tokenizer=char_tokenizer(), dtype_reason="auto: mocked")
    records = run_case(lm16, Case("c", _edit(), gold=("1",), answer_ids=(2,)), ("Shift", "Re-prefill"), [],
                       max_new_tokens=2)
    assert {r.dtype for r in records} == {"bfloat16"} and {r.dtype_reason for r in records} == {"auto: mocked"}
    assert all(math.isfinite(r.tv_reprefill) for r in records)
