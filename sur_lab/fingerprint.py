"""Fingerprints of everything a stored result depends on, so that nothing stale is reused silently.

A leaf of the core layer (it imports nothing from sur_lab), so that every layer may fingerprint what it stores.

A stored result (a sweep record, a per-case reference, a cached document KV cache) is valid only for the exact
inputs that made it: the model's identity (name *and* weights), its parameter dtype and device, the executor, the
allocator options, the decoding settings, the case's content and the software versions. :func:`model_fingerprint`
and :func:`describe` turn those into flat JSON-safe fields; :func:`digest` hashes a field dict; :func:`first_difference`
names the first field on which a stored fingerprint and the current one differ (callers raise a ``ValueError`` naming
it, or write to a new folder).

The weights hash is BLAKE2b (16-byte digest) over every parameter's and buffer's name, dtype, shape and raw bytes, in
``named_parameters`` / ``named_buffers`` order. It is computed once per module and cached; the cache is invalidated
when any parameter is replaced or modified in place (the tensors' ``data_ptr`` and autograd version counter form the
cache key). Hashing costs a few seconds once per model (SmolLM2-135M in float32: ~2-4 s on a busy shared CPU).
"""

from __future__ import annotations

import hashlib
import json
import math
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

#: The digest size of every fingerprint hash, bytes (32 hex characters).
DIGEST_BYTES = 16

# module -> (stamp, hex digest); weak keys so that a dropped model frees its entry.
_WEIGHTS_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]]" = weakref.WeakKeyDictionary()


def versions() -> str:
    """``"sur_lab X, torch Y, transformers Z"``: the software a stored result was computed with."""
    import sys

    import transformers

    # The package is imported before any of its modules, so it is in sys.modules; importing it here instead would be an
    # import cycle (sur_lab/__init__ imports the modules that use this one).
    version = sys.modules["sur_lab"].__version__
    return f"sur_lab {version}, torch {torch.__version__}, transformers {transformers.__version__}"


def _tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters(remove_duplicate=True)) + list(module.named_buffers(remove_duplicate=True))


def _stamp(tensors: list[tuple[str, torch.Tensor]]) -> tuple:
    out = []
    for name, t in tensors:
        try:
            version = t._version
        except RuntimeError:  # inference tensors keep no version counter; their storage pointer still changes on swap
            version = -1
        out.append((name, t.data_ptr(), version, tuple(t.shape), str(t.dtype)))
    return tuple(out)


def weights_hash(model: torch.nn.Module | Any) -> str:
    """BLAKE2b hex digest (32 characters) of a module's parameters and buffers: names, dtypes, shapes and bytes.

    Args:
        model: a ``torch.nn.Module`` or a :class:`sur_lab.models.LoadedModel` (its ``model``).

    Returns:
        The digest; cached per module until a parameter or buffer is replaced or modified in place.

    Raises:
        ValueError: naming ``model`` when it is neither a module nor a LoadedModel.
    """
    # A LoadedModel holds its module in .model; a *ForCausalLM module's own .model is the inner decoder (no LM head).
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or a LoadedModel; got {type(model).__name__}")
    tensors = _tensors(module)
    stamp = _stamp(tensors)
    hit = _WEIGHTS_CACHE.get(module)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    with torch.no_grad():
        for name, t in tensors:
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            flat = t.detach().reshape(-1).contiguous().cpu()
            # Raw bytes whatever the dtype (numpy has no bfloat16): reinterpret as uint8 without copying.
            if flat.numel():
                h.update(flat.view(torch.uint8).numpy().data)  # a buffer view: no copy of the bytes
    digest = h.hexdigest()
    _WEIGHTS_CACHE[module] = (stamp, digest)
    return digest


def device_name(device: torch.device | str) -> str:
    """``"cpu"``, or ``"cuda:0 (NVIDIA H200)"``: GPUs of different kinds round differently."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def model_fingerprint(lm: Any) -> dict[str, str]:
    """The model's identity as flat fields: ``model`` (name), ``dtype`` (e.g. ``"float32"``), ``device``
    (:func:`device_name`) and ``model_weights`` (:func:`weights_hash`).

    Args:
        lm: a :class:`sur_lab.models.LoadedModel`.
    """
    # dtype and device come before the weights hash: a dtype change also changes the weights' bytes, and the error
    # should name the dtype.
    return {
        "model": str(lm.spec.name),
        "dtype": str(lm.dtype).removeprefix("torch."),
        "device": device_name(lm.device),
        "model_weights": weights_hash(lm.model),
    }


def dtype_reason(lm: Any) -> str:
    """Why ``lm`` runs in its parameter dtype (:attr:`sur_lab.models.LoadedModel.dtype_reason`): ``"requested"``, or
    the choice of ``dtype="auto"`` with its reason. Records carry it beside their ``dtype``.

    Args:
        lm: a :class:`sur_lab.models.LoadedModel` (anything else: ``"requested"``).
    """
    return str(getattr(lm, "dtype_reason", "requested") or "requested")


def dtype_line(lm: Any) -> str:
    """The dtype a run used and why, for its "This run" line: ``"bfloat16 (auto: the CPU computes bfloat16 natively
    (avx512_bf16))"``, or ``"float32 (requested)"``.

    Args:
        lm: a :class:`sur_lab.models.LoadedModel`.
    """
    return f"{str(lm.dtype).removeprefix('torch.')} ({dtype_reason(lm)})"


def describe(value: Any) -> Any:
    """A JSON-safe, deterministic description of an option value for fingerprints.

    Models become their :func:`model_fingerprint`, tensors and arrays a hash of dtype, shape and bytes, mappings and
    sequences are described element-wise, callables by their qualified name, other objects by type name and ``repr``.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (np.generic,)):
        return describe(value.item())
    if hasattr(value, "spec") and hasattr(value, "model") and isinstance(getattr(value, "model"), torch.nn.Module):
        return {"model_fingerprint": model_fingerprint(value)}
    if isinstance(value, torch.nn.Module):
        return {"module": type(value).__name__, "weights": weights_hash(value)}
    if isinstance(value, (torch.Tensor, np.ndarray)):
        t = torch.as_tensor(value).detach().reshape(-1).contiguous().cpu()
        h = hashlib.blake2b(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"", digest_size=DIGEST_BYTES)
        return {"tensor": str(t.dtype).removeprefix("torch."), "shape": list(value.shape), "hash": h.hexdigest()}
    if isinstance(value, Mapping):
        return {str(k): describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [describe(v) for v in items]
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return f"{type(value).__name__}:{value!r}"


def digest(fields: Mapping[str, Any]) -> str:
    """BLAKE2b hex digest (32 characters) of ``describe(fields)`` serialized as sorted-key JSON."""
    text = json.dumps(describe(dict(fields)), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).hexdigest()


def first_difference(stored: Mapping[str, Any], expected: Mapping[str, Any]) -> str | None:
    """The first key of ``expected`` (in its order) whose value differs in ``stored`` (a missing key differs);
    ``None`` when all agree."""
    for key, value in expected.items():
        if key not in stored or stored[key] != value:
            return key
    return None


__all__ = ["DIGEST_BYTES", "describe", "device_name", "digest", "dtype_line", "dtype_reason", "first_difference",
           "model_fingerprint", "versions", "weights_hash"]
