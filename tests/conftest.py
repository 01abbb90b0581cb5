"""Shared fixtures: tiny random Llama and Qwen3 models built from configs (float64 throughout: float64 RoPE angles and
float64 RMSNorm), the embedded
SmolLM2 model (session-scoped, marked slow by the tests that use it), and the QA data directory."""

from __future__ import annotations

import os

from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton decorates its own helpers when it is first imported, so the interpreter must be chosen before any test module
# imports triton (directly or through sur_lab.executors.kernels); without a GPU the kernels run under the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def tiny_config(kind: str = "llama", *, vocab_size: int = 96, layers: int = 3, heads: int = 4, kv_heads: int = 2,
                head_dim: int = 16, hidden: int = 48, rope_theta: float = 10_000.0):
    """A tiny GQA config of ``kind`` ("llama" or "qwen3"; Qwen3 has q/k RMS norms)."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, tie_word_embeddings=False,
    )
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "qwen3":
        return Qwen3Config(**common, use_sliding_window=False)
    raise ValueError(kind)


def make_tiny_model(kind: str = "llama", seed: int = 0, dtype=torch.float64, **config_kwargs):
    """Build a tiny random model wrapped as a LoadedModel, with float64 RoPE angles and float64 RMSNorm (for float64
    models) so that exactness tests resolve fp64 rounding (~1e-15), not float32 normalisation (~1e-10)."""
    from transformers import AutoModelForCausalLM

    from sur_lab.models import enable_float64_rope, wrap_model

    torch.manual_seed(seed)
    config = tiny_config(kind, **config_kwargs)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    # Random init gives tiny weights; scale the attention projections so attention is far from uniform and the
    # deleted span visibly changes the suffix states.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    enable_float64_rope(model)
    enable_float64_norm(model)
    return wrap_model(model, None, f"tiny-{kind}")


def enable_float64_norm(model):
    """Make every RMSNorm of ``model`` normalise in its input dtype when that is float64 (in place; returns it).

    transformers' RMSNorm upcasts to float32 (``hidden_states.to(torch.float32)``) whatever the model dtype, so a
    "float64" model still rounds every normalisation to float32 (~6e-8 relative) and exactness tests could only
    resolve ~1e-10: an error of 1e-12 in every attention output went unnoticed. With this patch the tiny float64
    models are float64 end to end (RoPE angles: :func:`sur_lab.models.enable_float64_rope`), so 1e-13 tolerances mean
    what they say. Inputs of other dtypes keep transformers' behaviour.
    """
    import types

    def forward(self, hidden_states):  # noqa: ANN001 - mirrors transformers' RMSNorm.forward
        if hidden_states.dtype != torch.float64:
            return type(self).forward(self, hidden_states)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(forward, module)
    return model


@pytest.fixture(params=["llama", "qwen3"])
def tiny_lm(request):
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M-Instruct (loads once per session)."""
    from sur_lab.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def smol_tokenizer(smol):
    return smol.tokenizer


@pytest.fixture(scope="session")
def data_dir():
    from sur_lab.paths import default_data_dir

    try:
        return default_data_dir()
    except FileNotFoundError as err:
        pytest.skip(str(err))


#: The Qwen2.5 tokenizer files for fast tests (the workspace's shared data; no model weights).
QWEN_TOKENIZER_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tokenizers" / (
    "qwen2.5-coder-0.5b-instruct")
if not QWEN_TOKENIZER_DIR.is_dir():
    QWEN_TOKENIZER_DIR = Path("/work/shared/data/tokenizers/qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5"])
def tokenizer(request):
    """A real tokenizer of each embedded model family (SmolLM2's from its package, Qwen2.5's from the shared
    tokenizer files); skipped where its files are missing."""
    from transformers import AutoTokenizer

    if request.param == "qwen2.5":
        if not (QWEN_TOKENIZER_DIR / "tokenizer.json").is_file():
            pytest.skip(f"Qwen2.5 tokenizer files not found at {QWEN_TOKENIZER_DIR}")
        return AutoTokenizer.from_pretrained(QWEN_TOKENIZER_DIR)
    from sur_lab.models import embedded_tokenizer

    try:
        return embedded_tokenizer()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {err}")


#: float64 unit roundoff (2^-52).
FP64_EPS = torch.finfo(torch.float64).eps
#: Rounding allowance, in units of FP64_EPS times the reference's largest magnitude, for two float64 computations of
#: the tiny models that agree in real arithmetic but differ in shape or order (row counts change GEMM blocking): a
#: few dot products of length <= 2 * hidden (96) per layer, 3 layers. 64 ulp of the scale is ~6e-14 here, far below
#: what an injected 1e-12 error in every attention output produces (~3e-10; see test_repair_exactness).
FP64_ULPS = 64


def fp64_tol(*references, ulps: int = FP64_ULPS) -> float:
    """Absolute tolerance ``ulps * eps64 * max|reference|`` over tensors or caches (``DynamicCache``)."""
    scale = 0.0
    for ref in references:
        if isinstance(ref, torch.Tensor):
            scale = max(scale, ref.detach().abs().max().item() if ref.numel() else 0.0)
        else:  # a DynamicCache: every layer's keys and values
            for layer in ref.layers:
                scale = max(scale, layer.keys.abs().max().item(), layer.values.abs().max().item())
    return ulps * FP64_EPS * max(scale, 1.0)


def hf_prefill(lm, ids):
    """Oracle: a plain transformers prefill of ``ids`` ``[N]`` (no sur_lab code): ``(per-layer (K, V), logits)``.

    Returns the keys and values ``[1, H_kv, N, d_h]`` of every layer read straight from transformers' ``DynamicCache``
    and the float logits ``[N, V]``.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        out = lm.model(input_ids=ids[None], cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers], out.logits[0]
