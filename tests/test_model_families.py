"""Mixture-of-experts families and partial rotary embeddings (issue 16): Qwen2-MoE, Qwen3-MoE, Mixtral and GLM-4.5
(``glm4_moe``, partial rotary 0.5 and 0.25), on tiny random float64 configs with GQA and mixed dense/MoE layers.

Exactness: the models are float64 end to end. transformers' RMSNorm upcasts to float32 (which for a float64 model is a
downcast), so the test models get float64 norms, and float64 RoPE angles (:func:`sur_lab.models.enable_float64_rope`);
the experts run the eager backend (``grouped_mm`` has no float64 kernel; :func:`sur_lab.models.wrap_model` switches).
The Qwen and Mixtral routers keep their own float32 softmax: a float32 rounding of float64 logits that differ by ~1e-16
between two traversals changes the result only if it straddles a float32 rounding boundary (odds ~1e-9 per value).
GLM-4.5's router instead forms its logits with a float32 GEMM, whose rounding depends on the row count (packed vs
sequential differ by ~7e-9 through it), so the test models run that router in float64 (same code). With that,
every comparison below is pure float64 reduction-order rounding (~1e-15), so 1e-12 is a bound that a wrong rotation,
position, routing row or write order misses by orders of magnitude.
"""

from __future__ import annotations

import os
import types

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton (its decorators read it then); see test_kernels.py.
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from sur_lab.allocators import AllocationRequest, allocate  # noqa: E402
from sur_lab.allocators import prior  # noqa: E402
from sur_lab.budget import Support, allowance  # noqa: E402
from sur_lab.cache_ops import (  # noqa: E402
    caches_equal, clone_cache, layer_kv, max_abs_diff, rerotate_keys, rotate_half, shift_cache, to_tensors,
)
from sur_lab.edits import token_edit  # noqa: E402
from sur_lab.executors import get_executor, reprefill  # noqa: E402
from sur_lab.models import (  # noqa: E402
    MOE_MODEL_TYPES, UnsupportedModelError, check_supported, enable_float64_rope, load_model, wrap_model,
)
from sur_lab.repair import REFERENCE_METHODS, prepare, repair  # noqa: E402
from sur_lab.studies.niah import PAPER_ALLOCATORS  # noqa: E402

EXACT = 1e-12
#: Executors that must equal "sequential" in float64 (compiled flex and Triton are checked apart).
EXACT_EXECUTORS = ["packed", "packed-sdpa", "packed-sdpa-split", "packed-flex-eager", "direct-sequential", "one-shot"]

_COMMON = dict(
    vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False,
)
_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}

#: name -> (model_type, config fields, number of MoE layers among the 3). GQA 4/2 everywhere.
FAMILIES = {
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24), 3),
    "qwen3_moe-mixed": (
        "qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[0]), 2,
    ),
    "qwen2_moe-mixed": (
        "qwen2_moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24,
             decoder_sparse_step=2),
        1,
    ),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), 3),
    "glm4_moe-rot0.5": (
        "glm4_moe",
        dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, first_k_dense_replace=1,
             use_qk_norm=True, rope_parameters=dict(_ROPE, partial_rotary_factor=0.5)),
        2,
    ),
    "glm4_moe-rot0.25": (
        "glm4_moe",
        dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, first_k_dense_replace=0,
             n_group=2, topk_group=1, rope_parameters=dict(_ROPE, partial_rotary_factor=0.25)),
        3,
    ),
}


def family_config(name: str, **overrides):
    from transformers import AutoConfig

    model_type, fields, _ = FAMILIES[name]
    kwargs = dict(_COMMON, rope_parameters=_ROPE) | fields | overrides
    return AutoConfig.for_model(model_type, **kwargs)


def _float64_rms_norm(self, hidden_states):  # noqa: ANN001 - mirrors transformers' RMSNorm.forward
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _float64_glm_router(self, hidden_states):  # noqa: ANN001 - Glm4MoeTopkRouter.forward in the input dtype
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight.to(hidden_states.dtype))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    per_group = self.num_experts // self.num_group
    group_scores = scores_for_choice.view(-1, self.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


def make_family_model(name: str, dtype=torch.float64, seed: int = 0, **overrides):
    """A tiny random model of family ``name`` wrapped as a LoadedModel: float64 norms and RoPE angles, sharpened
    attention and routing (random init gives near-uniform ones)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = family_config(name, **overrides)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("q_proj.weight", "k_proj.weight", "mlp.gate.weight")):
                p.mul_(8.0)
    if dtype == torch.float64:
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.forward = types.MethodType(_float64_rms_norm, module)
            if type(module).__name__ == "Glm4MoeTopkRouter":
                module.forward = types.MethodType(_float64_glm_router, module)
    enable_float64_rope(model)
    return wrap_model(model, None, f"tiny-{name}")


def make_edit(vocab=96, n=64, p=9, d=6, q=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return token_edit(torch.randint(0, vocab, (n,), generator=g), p, d, torch.randint(0, vocab, (q,), generator=g))


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request):
    lm = make_family_model(request.param)
    edit = make_edit()
    return request.param, lm, edit, prepare(lm, edit)


def _max_diff(a, b, rows=slice(None)) -> float:
    return max(max_abs_diff(a, b, rows))


# ---------------------------------------------------------------------------------------------------------------------
# The configurations are what they claim to be


def test_families_have_the_layer_mix_and_rotary_width_they_claim(case):
    name, lm, _, _ = case
    model_type, fields, moe_layers = FAMILIES[name]
    assert lm.spec.model_type == model_type and lm.spec.is_moe and lm.spec.num_kv_heads < lm.spec.num_heads
    kinds = [type(layer.mlp).__name__ for layer in lm.model.model.layers]
    assert sum(not k.endswith("MLP") for k in kinds) == moe_layers, kinds
    factor = fields.get("rope_parameters", {}).get("partial_rotary_factor", 1.0)
    assert lm.spec.rotary_dim == int(16 * factor) == 2 * lm.inv_freq.numel()
    assert lm.model.config._experts_implementation == "eager"  # wrap_model's float64 switch


# ---------------------------------------------------------------------------------------------------------------------
# Shift, the reference operators, executors


def test_shift_layer0_equals_a_prefill_at_the_new_positions(case):
    _, lm, edit, prep = case
    ref = reprefill(lm, edit)
    (k_s, v_s), (k_r, v_r), (k_d, _) = layer_kv(prep.shift_cache, 0), layer_kv(ref, 0), layer_kv(prep.dirty_cache, 0)
    assert (k_s - k_r).abs().max().item() <= EXACT and (v_s - v_r).abs().max().item() <= EXACT
    # Not vacuous: the suffix keys did move; partial rotary: the pass-through dimensions are the Dirty ones, bitwise.
    width, end = lm.spec.rotary_dim, edit.prefix_len + edit.deleted_len
    assert (k_s[:, :, edit.prefix_len :, :width] - k_d[:, :, end:, :width]).abs().max().item() > 1e-3
    assert torch.equal(k_s[:, :, edit.prefix_len :, width:], k_d[:, :, end:, width:])


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        {"rope_type": "linear", "factor": 2.0},
    ],
    ids=lambda r: r["rope_type"],
)
def test_shift_with_scaled_partial_rotary_equals_a_prefill(rope):
    lm = make_family_model("glm4_moe-rot0.5", rope_parameters=dict(_ROPE, partial_rotary_factor=0.5, **rope))
    assert lm.spec.rope_type == rope["rope_type"] and lm.spec.rotary_dim == 8
    edit = make_edit()
    prep = prepare(lm, edit)
    ref = reprefill(lm, edit)
    assert (layer_kv(prep.shift_cache, 0)[0] - layer_kv(ref, 0)[0]).abs().max().item() <= EXACT


def _supports(suffix_len: int) -> dict[str, Support]:
    return {
        "intervals": Support(np.r_[0:3, 10:14, 30:31, 40:suffix_len - 2], suffix_len),
        "single_last": Support(np.array([suffix_len - 1]), suffix_len),
    }


@pytest.mark.parametrize("support_name", ["intervals", "single_last"])
def test_every_executor_equals_sequential(case, support_name):
    _, lm, edit, prep = case
    support = _supports(edit.suffix_len)[support_name]
    before = clone_cache(prep.shift_cache)
    ref = get_executor("sequential")(lm, prep.shift_cache, edit, support)
    assert _max_diff(ref, prep.shift_cache) > 1e-3  # the refresh changes the selected rows
    absolute = torch.as_tensor(support.absolute(edit.prefix_len))
    keep = torch.ones(edit.edited_len, dtype=torch.bool)
    keep[absolute] = False
    for name in EXACT_EXECUTORS:
        out = get_executor(name)(lm, prep.shift_cache, edit, support)
        assert _max_diff(out, ref) <= EXACT, name
        for (k, v), (ks, vs) in zip(to_tensors(out), to_tensors(prep.shift_cache)):
            assert torch.equal(k[:, :, keep], ks[:, :, keep]) and torch.equal(v[:, :, keep], vs[:, :, keep]), name
        assert caches_equal(prep.shift_cache, before), f"{name} modified its input cache"


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "glm4_moe-rot0.5"])
def test_executors_with_router_logits_requested(name):
    """``output_router_logits=True`` makes the Qwen/Mixtral heads compute a load-balancing loss that reads the
    attention mask as 2-D padding; one-shot's 4-D mask must not reach it."""
    lm = make_family_model(name, output_router_logits=True)
    edit = make_edit()
    prep = prepare(lm, edit)
    support = _supports(edit.suffix_len)["intervals"]
    ref = get_executor("sequential")(lm, prep.shift_cache, edit, support)
    for executor in ("one-shot", "packed-sdpa"):
        assert _max_diff(get_executor(executor)(lm, prep.shift_cache, edit, support), ref) <= EXACT, executor


def test_full_budget_equals_reprefill_and_inputs_are_unchanged(case):
    _, lm, edit, prep = case
    dirty_before, shift_before = clone_cache(prep.dirty_cache), clone_cache(prep.shift_cache)
    ref = reprefill(lm, edit)
    full = Support.full(edit.suffix_len)
    assert repair(lm, prep, "SUR", 100).allowance == edit.suffix_len
    assert _max_diff(repair(lm, prep, "SUR", 100).cache, ref) <= EXACT
    for name in ("sequential", "packed-sdpa", "one-shot"):
        assert _max_diff(get_executor(name)(lm, prep.shift_cache, edit, full), ref) <= EXACT, name
    for method in REFERENCE_METHODS:
        out = repair(lm, prep, method)
        expected = edit.num_tokens if method == "Dirty" else edit.edited_len
        assert out.cache.get_seq_length() == expected
        if method in ("Replay", "Re-prefill"):
            assert _max_diff(out.cache, ref) <= EXACT, method
    assert caches_equal(prep.dirty_cache, dirty_before) and caches_equal(prep.shift_cache, shift_before)


@pytest.mark.parametrize("name", ["glm4_moe-rot0.5", "qwen3_moe-mixed"])
def test_packed_triton_under_the_interpreter(name):
    """The Triton backend (float32, head dim 64) on a partial-rotary MoE and a mixed MoE model, against sequential,
    within 4x the SDPA path's own float32 error plus a floor of a few ulps (as in test_packed.py)."""
    from sur_lab.executors.kernels import uses_triton

    if not uses_triton("cpu") and not torch.cuda.is_available():
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: the kernel path is not exercised")
    lm = make_family_model(name, dtype=torch.float32, head_dim=64, hidden_size=64, num_hidden_layers=2)
    edit = make_edit(n=48, p=5, d=4)
    prep = prepare(lm, edit)
    support = Support(np.r_[0:3, 12:14, edit.suffix_len - 2 : edit.suffix_len], edit.suffix_len)
    before = clone_cache(prep.shift_cache)
    ref = get_executor("sequential")(lm, prep.shift_cache, edit, support)
    sdpa_err = _max_diff(get_executor("packed-sdpa")(lm, prep.shift_cache, edit, support), ref)
    for executor in ("packed-triton", "packed-triton-fused"):
        assert _max_diff(get_executor(executor)(lm, prep.shift_cache, edit, support), ref) <= 4 * sdpa_err + 1e-5
    assert caches_equal(prep.shift_cache, before)


# ---------------------------------------------------------------------------------------------------------------------
# Allocators that read model internals


def test_every_paper_allocator_returns_exactly_b_positions(case):
    _, lm, edit, prep = case
    for method in PAPER_ALLOCATORS:
        request = AllocationRequest(
            lm, edit, 20, shift_cache=prep.shift_cache, options={"dirty_cache": prep.dirty_cache, "aux_model": lm}
        )
        positions = allocate(method, request).support.positions
        assert len(np.unique(positions)) == allowance(edit.suffix_len, 20), method
        assert positions.min() >= 0 and positions.max() < edit.suffix_len, method


@pytest.mark.parametrize("name", ["glm4_moe-rot0.5", "mixtral"])
def test_query_attention_probe_equals_eager_attention(name):
    """The probe recomputes queries with partial rotary; eager attention (float32 softmax) is the reference."""
    lm = make_family_model(name)
    eager = make_family_model(name)
    eager.model.config._attn_implementation = "eager"
    edit = make_edit(q=5)
    p, S, Q = edit.prefix_len, edit.suffix_len, 5
    prep = prepare(lm, edit)
    mean, l2, n = prior.query_attention_stats(lm, prep.shift_cache, edit)
    out = eager.model(
        input_ids=edit.query_ids[None], cache=clone_cache(prep.shift_cache),
        position_ids=torch.arange(p + S, p + S + Q)[None], use_cache=True, output_attentions=True,
    )
    att = torch.stack(out.attentions)[:, 0, :, :, p : p + S]  # (L, H, Q, S)
    assert n == Q
    np.testing.assert_allclose(mean, att.mean(dim=(0, 1, 2)).numpy(), rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(l2, att.square().sum(dim=(0, 1, 2)).sqrt().numpy(), rtol=1e-6, atol=1e-12)


def test_unrotate_keys_recovers_prerope_keys_with_partial_rotary():
    lm = make_family_model("glm4_moe-rot0.25")
    edit = make_edit()
    prep = prepare(lm, edit)
    p, S = edit.prefix_len, edit.suffix_len
    attn = lm.model.model.layers[0].self_attn
    hidden = lm.model.model.layers[0].input_layernorm(lm.model.model.embed_tokens(edit.edited_ids[None]))
    pre = attn.k_proj(hidden).view(1, -1, lm.spec.num_kv_heads, lm.spec.head_dim)
    pre = (attn.k_norm(pre) if hasattr(attn, "k_norm") else pre).transpose(1, 2)[0, :, p:]
    got = prior.unrotate_keys(layer_kv(prep.shift_cache, 0)[0][0, :, p:], torch.arange(p, p + S), lm.inv_freq)
    torch.testing.assert_close(got.double(), pre, rtol=0, atol=1e-5)  # FP32 output


# ---------------------------------------------------------------------------------------------------------------------
# Refusals: named field, before any work


REFUSALS = [
    ("qwen3_moe", {"rope_parameters": dict(_ROPE, partial_rotary_factor=0.5)}, "partial_rotary_factor"),
    ("mixtral", {"rope_parameters": dict(_ROPE, partial_rotary_factor=0.5)}, "partial_rotary_factor"),
    ("glm4_moe-rot0.5", {"rope_parameters": dict(_ROPE, partial_rotary_factor=0.1)}, "partial_rotary_factor"),
    ("glm4_moe-rot0.5", {"rope_parameters": dict(_ROPE, partial_rotary_factor=0.3125)}, "partial_rotary_factor"),
    ("glm4_moe-rot0.5", {"rope_parameters": dict(_ROPE, rope_type="dynamic", factor=2.0)}, "rope_type"),
    ("mixtral", {"sliding_window": 16}, "sliding_window"),
    ("qwen2_moe-mixed", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, "sliding"),
    ("qwen3_moe", {"expert_capacity": 8}, "expert_capacity"),
    ("mixtral", {"moe_capacity_factor": 1.25}, "moe_capacity_factor"),
]


@pytest.mark.parametrize("name, overrides, field", REFUSALS)
def test_refusals_name_the_field(name, overrides, field):
    with pytest.raises(UnsupportedModelError, match=field):
        check_supported(family_config(name, **overrides))


def test_unknown_experts_backend_and_moe_fields_on_dense_families_are_refused():
    config = family_config("qwen3_moe")
    config._experts_implementation = "my_dropping_kernel"
    with pytest.raises(UnsupportedModelError, match="_experts_implementation"):
        check_supported(config)
    from transformers import LlamaConfig

    with pytest.raises(UnsupportedModelError, match="num_local_experts"):
        check_supported(LlamaConfig(**_COMMON, num_local_experts=4))


@pytest.mark.parametrize("name, overrides, field", REFUSALS[:3])
def test_load_model_refuses_from_the_config_before_loading_weights(tmp_path, name, overrides, field):
    family_config(name, **overrides).save_pretrained(tmp_path)  # no weights, no tokenizer: only the config check runs
    with pytest.raises(UnsupportedModelError, match=field):
        load_model(str(tmp_path))


def test_wrap_model_refuses_a_rotary_embedding_of_the_wrong_width():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(family_config("glm4_moe-rot0.5"))
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq[:2]  # 4 rotary dims where the config says 8
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        wrap_model(model)


def test_moe_families_listed():
    assert set(MOE_MODEL_TYPES) == {"qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe"}
    assert {FAMILIES[n][0] for n in FAMILIES} == set(MOE_MODEL_TYPES)


# ---------------------------------------------------------------------------------------------------------------------
# Shift's low-precision arithmetic (issue 12, kind 8): float32 rotation, one rounding


def _rotation_bound(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor):
    """float64 reference ``R_delta K`` of the (exactly representable) low-precision keys, and the per-element error
    allowed to Shift: that of rounding the reference once to the key dtype plus the float32 arithmetic's own error
    (a few float32 ulps of the terms), which can tip a value sitting at a rounding midpoint to the other neighbour."""
    k = keys.double()
    angles = float(delta) * inv_freq.double()
    emb = torch.cat((angles, angles))
    width = emb.numel()
    rot, rest = k[..., :width], k[..., width:]
    ref = torch.cat((rot * emb.cos() + rotate_half(rot) * emb.sin(), rest), dim=-1)
    cast_err = (ref.to(keys.dtype).double() - ref).abs()
    terms = torch.cat((rot.abs() + rotate_half(rot).abs(), torch.zeros_like(rest)), dim=-1)
    eps32 = torch.finfo(torch.float32).eps
    return ref, cast_err + 4 * eps32 * terms + torch.finfo(keys.dtype).tiny


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_low_precision_shift_error_is_one_rounding_of_the_float64_result(dtype, rotary_dim):
    gen = torch.Generator().manual_seed(3)
    keys = (torch.randn(1, 4, 257, 64, generator=gen, dtype=torch.float64) * 3).to(dtype)
    inv_freq = 1.0 / (10_000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    worst_naive = 0.0
    for delta in (-1, -7, -123, -4001):
        ref, allowed = _rotation_bound(keys, delta, inv_freq)
        got = rerotate_keys(keys, delta, inv_freq)
        assert got.dtype == dtype
        assert bool(((got.double() - ref).abs() <= allowed).all()), f"delta={delta}"
        # The bound discriminates: rotating in the key dtype itself (cos, sin and products rounded) exceeds it.
        emb = torch.cat((delta * inv_freq, delta * inv_freq))
        rot = keys[..., :rotary_dim]
        naive = rot * emb.cos().to(dtype) + rotate_half(rot) * emb.sin().to(dtype)
        ratio = (naive.double() - ref[..., :rotary_dim]) / allowed[..., :rotary_dim]
        worst_naive = max(worst_naive, ratio.max().item())
    assert worst_naive > 1.0


def test_shift_cache_re_rotates_only_the_rotary_dimensions():
    gen = torch.Generator().manual_seed(5)
    layers = [(torch.randn(1, 2, 20, 16, generator=gen, dtype=torch.float64),) * 2 for _ in range(2)]
    from sur_lab.cache_ops import from_tensors

    cache = from_tensors(layers)
    inv_freq = 1.0 / (10_000.0 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4))  # rotary_dim 4 of 16
    out = shift_cache(cache, 5, 3, inv_freq)
    k, _ = layer_kv(out, 0)
    k0 = layers[0][0]
    assert torch.equal(k[:, :, 5:, 4:], k0[:, :, 8:, 4:]) and torch.equal(k[:, :, :5], k0[:, :, :5])
    back = rerotate_keys(k[:, :, 5:], 3, inv_freq)
    assert (back - k0[:, :, 8:]).abs().max().item() <= 1e-14
    with pytest.raises(ValueError, match="inv_freq"):
        rerotate_keys(k0, 1, torch.ones(9, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------------------
# Notebooks on a model loaded from a local directory


@pytest.mark.slow
@pytest.mark.parametrize("notebook", ["00_quickstart", "02_allocation_geometry"])
@pytest.mark.parametrize("name", ["qwen3_moe-mixed", "glm4_moe-rot0.5"])
def test_notebooks_run_on_a_local_moe_directory(name, notebook, smol_tokenizer, tmp_path, monkeypatch):
    """save_pretrained of a tiny random MoE (partial rotary for GLM) with the embedded model's tokenizer, then the
    notebook at its smoke parameters with ``model_name`` set to that directory."""
    from transformers import AutoModelForCausalLM

    from sur_lab.runtime.run_notebooks import NOTEBOOK_DIR, run_notebook, smoke_parameters

    model_dir = tmp_path / f"tiny-{name}"
    config = family_config(
        name, vocab_size=len(smol_tokenizer), hidden_size=64, eos_token_id=smol_tokenizer.eos_token_id,
        bos_token_id=smol_tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    smol_tokenizer.save_pretrained(model_dir)
    outputs = tmp_path / "outputs"
    monkeypatch.setenv("SUR_LAB_OUTPUTS_DIR", str(outputs))
    path = NOTEBOOK_DIR / f"{notebook}.ipynb"
    executed = run_notebook(path, smoke_parameters(path) | {"model_name": str(model_dir)}, outputs=outputs,
                            progress=False)
    assert executed.is_file() and f"tiny-{name}" in executed.read_text()
    assert list((outputs / "tables").glob("*.csv")) or list((outputs / "tables").glob("*.parquet"))


# ---------------------------------------------------------------------------------------------------------------------
# Issue 24 (edit sessions): partial rotary wherever keys are re-rotated. Shift (rerotate_keys) and sessions
# (rerotate_rows) share one helper; sessions and repair_cache on GLM-4.5 give a clean prefill at 100 % and layer 0
# of a prefill at the new positions at 0 %.

PARTIAL = ["glm4_moe-rot0.5", "glm4_moe-rot0.25"]


@pytest.mark.parametrize("rotary", [16, 8, 4])
def test_rerotate_rows_and_rerotate_keys_are_one_rotation(rotary):
    from sur_lab.cache_ops import rerotate_rows

    gen = torch.Generator().manual_seed(7)
    inv_freq = 1.0 / (10_000.0 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        keys = torch.randn(1, 2, 9, 16, generator=gen, dtype=torch.float64).to(dtype)
        for delta in (-5, 0, 11):
            same = rerotate_rows(keys, torch.full((9,), delta), inv_freq)
            assert torch.equal(same, rerotate_keys(keys, delta, inv_freq)), (dtype, delta)
            assert torch.equal(same[..., rotary:], keys[..., rotary:])  # pass-through dims bitwise
        deltas = torch.arange(-4, 5)
        per_row = rerotate_rows(keys, deltas, inv_freq)
        for j, delta in enumerate(deltas.tolist()):
            assert torch.equal(per_row[:, :, j], rerotate_keys(keys[:, :, j : j + 1], delta, inv_freq)[:, :, 0])


def _session_program(session, rng):
    """append 40, delete [5, 12), replace [20, 23) by 4 tokens, append 6, delete [30, 33); returns the ids."""
    ids = torch.randint(0, 96, (40,), generator=rng)
    session.append(ids)
    session.delete(5, 12)
    new = torch.randint(0, 96, (4,), generator=rng)
    session.replace(20, 23, new)
    tail = torch.randint(0, 96, (6,), generator=rng)
    session.append(tail)
    session.delete(30, 33)
    expected = torch.cat((ids[:5], ids[12:27], new, ids[30:], tail))
    return torch.cat((expected[:30], expected[33:]))


@pytest.mark.parametrize("name", PARTIAL)
def test_sessions_on_partial_rotary_give_a_clean_prefill_at_full_budget(name):
    from sur_lab import EditSession
    from sur_lab.forward import prefill

    lm = make_family_model(name)
    session = EditSession(lm, method="SUR", budget_pct=100)
    expected = _session_program(session, torch.Generator().manual_seed(3))
    assert torch.equal(session.tokens, expected) and session.debt == 0
    assert _max_diff(session.cache, prefill(lm, expected)[0]) <= EXACT


@pytest.mark.parametrize("name", PARTIAL)
def test_sessions_on_partial_rotary_keep_layer0_at_budget_zero(name):
    from sur_lab import EditSession
    from sur_lab.forward import prefill

    lm = make_family_model(name)
    session = EditSession(lm, method="Shift")
    expected = _session_program(session, torch.Generator().manual_seed(4))
    reference = prefill(lm, expected)[0]
    (k, v), (kr, vr) = layer_kv(session.cache, 0), layer_kv(reference, 0)
    width = lm.spec.rotary_dim
    assert (k[..., :width] - kr[..., :width]).abs().max().item() <= EXACT  # rotated dims: moved to the new positions
    assert (k[..., width:] - kr[..., width:]).abs().max().item() <= EXACT  # pass-through dims: untouched
    assert (v - vr).abs().max().item() <= EXACT
    assert _max_diff(session.cache, reference) > 1e-6  # deeper layers still carry the deleted text: not vacuous


@pytest.mark.parametrize("name", PARTIAL)
@pytest.mark.parametrize("budget", [0, 100])
def test_repair_cache_on_partial_rotary(name, budget):
    from sur_lab.session import repair_cache
    from sur_lab.forward import prefill

    lm = make_family_model(name)
    ids = torch.randint(0, 96, (50,), generator=torch.Generator().manual_seed(5))
    out = repair_cache(lm.model, prefill(lm, ids)[0], ids, (10, 18), budget_pct=budget)
    clean = prefill(lm, torch.cat((ids[:10], ids[18:])))[0]
    if budget == 100:
        assert _max_diff(out, clean) <= EXACT
    else:
        assert max((a - b).abs().max().item() for a, b in zip(layer_kv(out, 0), layer_kv(clean, 0))) <= EXACT
