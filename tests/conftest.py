"""Shared fixtures: tiny random Llama and Qwen3 models built from configs (float64, float64 RoPE angles), the embedded
SmolLM2 model (session-scoped, marked slow by the tests that use it), and the QA data directory."""

from __future__ import annotations

import os

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
    """Build a tiny random model wrapped as a LoadedModel, with float64 RoPE angles so exactness tests reach 1e-10."""
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
    return wrap_model(model, None, f"tiny-{kind}")


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
    from sur_lab.runtime.paths import default_data_dir

    try:
        return default_data_dir()
    except FileNotFoundError as err:
        pytest.skip(str(err))
