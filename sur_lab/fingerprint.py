"""Fingerprints of everything a stored result depends on, so that nothing stale is reused silently.

A leaf of the core layer (it imports nothing from sur_lab), so that every layer may fingerprint what it stores.

A stored result (a sweep record, a per-case reference, a cached document KV cache) is valid only for the exact
inputs that made it: the model's identity (name *and* weights), its parameter dtype and device, the executor, the
allocator options, the decoding settings, the case's content and the software versions. :func:`model_fingerprint`
and :func:`describe` turn those into flat JSON-safe fields; :func:`digest` hashes a field dict; :func:`first_difference`
names the first field on which a stored fingerprint and the current one differ (callers raise a ``ValueError`` naming
it, or write to a new folder).

The weights hash (:func:`weights_hash`) is BLAKE2b (16-byte digest) over every parameter's and buffer's name, dtype,
shape and raw bytes, in ``named_parameters`` / ``named_buffers`` order: what a result stored on disk records. Hashing
costs a few seconds per model (SmolLM2-135M in float32: ~2-4 s on a busy shared CPU), so it is cached per module under
the module's :func:`weights_digest`, the cheap check every in-process store keyed on the weights makes.

The weights digest sees in-place updates. A write through ``p.data`` (``p.data.copy_(new)``, ``p.data.add_(delta)``:
how RL trainers push new weights into an inference copy) changes neither the parameter's storage pointer nor its
autograd version counter (``.data`` is a tensor with a version counter of its own), so a key made of those two alone
stays the same while the weights change. :func:`weights_digest` therefore also hashes the content of
:data:`DIGEST_SAMPLES` elements of every parameter and buffer, in :data:`DIGEST_RUNS` runs spread over it (spaced
coprime with the last dimension, so the runs fall in different columns of successive rows), together with each
tensor's name, shape, dtype, storage pointer and version counter. An update that changes the weights almost everywhere (an optimizer step, a weight sync, a
``load_state_dict``) changes sampled elements; ``load_state_dict(assign=True)`` and ``p.data = t`` change the pointer;
in-place writes on the parameter itself (``copy_`` under ``torch.no_grad`` or ``torch.inference_mode``, optimizer
steps) bump the version counter. A ``.data`` write confined to elements between the samples (one row of a matrix) is
the one update it can miss; :func:`weights_hash` ``(model, full=True)`` hashes every byte again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sys
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import transformers

#: The digest size of every fingerprint hash, bytes (32 hex characters).
DIGEST_BYTES = 16
#: Elements of each parameter and buffer whose content :func:`weights_digest` hashes (all of a smaller tensor).
DIGEST_SAMPLES = 256
#: Runs of consecutive elements those samples come in, equally spaced over the tensor.
DIGEST_RUNS = 16

# module -> (weights digest, full hex digest); weak keys so that a dropped model frees its entry.
_WEIGHTS_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, str]]" = weakref.WeakKeyDictionary()


def versions() -> str:
    """``"sur_lab X, torch Y, transformers Z"``: the software a stored result was computed with."""
    # The package is imported before any of its modules, so it is in sys.modules; importing it here instead would be an
    # import cycle (sur_lab/__init__ imports the modules that use this one).
    version = sys.modules["sur_lab"].__version__
    return f"sur_lab {version}, torch {torch.__version__}, transformers {transformers.__version__}"


def _tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters(remove_duplicate=True)) + list(module.named_buffers(remove_duplicate=True))


def _module_of(model: torch.nn.Module | Any) -> torch.nn.Module:
    # A LoadedModel holds its module in .model; a *ForCausalLM module's own .model is the inner decoder (no LM head).
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or a LoadedModel; got {type(model).__name__}")
    return module


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter; their storage pointer still changes on swap
        return -1


@functools.lru_cache(maxsize=4096)
def _run_step(n: int, cols: int) -> int:
    """Spacing of :data:`DIGEST_RUNS` runs over ``n`` elements: as wide as possible, coprime with the row length
    ``cols`` (so the runs fall in different columns of successive rows)."""
    run = DIGEST_SAMPLES // DIGEST_RUNS
    step = (n - run) // (DIGEST_RUNS - 1)
    while step > run and math.gcd(step, cols) != 1:
        step -= 1
    return step


def _sample(t: torch.Tensor) -> torch.Tensor:
    """:data:`DIGEST_SAMPLES` elements of ``t`` spread over all of it: a ``[runs, run]`` view (``[1, n]``: all of a
    small tensor).

    :data:`DIGEST_RUNS` runs of consecutive elements, equally spaced: a run is a cache line or two, so a check costs
    about ``DIGEST_RUNS`` memory accesses per tensor (scattered single elements would cost one miss each). Made per
    check and never kept: a kept view would keep a replaced tensor's storage alive.
    """
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()  # a copy (parameters are contiguous)
    n = t.numel()
    if n <= DIGEST_SAMPLES:
        return t.reshape(1, n)
    step = _run_step(n, t.shape[-1])
    return t.as_strided((DIGEST_RUNS, DIGEST_SAMPLES // DIGEST_RUNS), (step, 1), t.storage_offset())


def weights_digest(model: torch.nn.Module | Any) -> str:
    """A cheap BLAKE2b hex digest (32 characters) that changes when a module's weights change, in place included.

    It hashes each parameter's and buffer's name, shape, dtype, storage pointer and autograd version counter, and the
    content of :data:`DIGEST_SAMPLES` elements of each, in :data:`DIGEST_RUNS` runs spread over the tensor (module
    docstring: which updates it sees and the one it can miss). A check walks the module tree once and gathers the
    samples in one copy per dtype: a few milliseconds on Qwen2.5-0.5B on a CPU (``scripts/weights_digest_cost.py``).
    Every in-process store keyed on the weights checks it (a SAFE-KV document store through
    :func:`model_fingerprint`, :class:`sur_lab.EditSession`'s live cache).

    Args:
        model: a ``torch.nn.Module`` or a :class:`sur_lab.models.LoadedModel` (its ``model``).

    Returns:
        The digest. Equal digests mean the same tensors with the same version counters and sampled values; any
        replacement of a tensor gives another digest even when its values are equal.

    Raises:
        ValueError: naming ``model`` when it is neither a module nor a LoadedModel.
    """
    module = _module_of(model)
    stamp, runs, small = [], {}, {}
    with torch.no_grad():
        for name, t in _tensors(module):
            if t.is_meta:
                stamp.append((name, 0, _version(t), tuple(t.shape), t.dtype))
                continue
            stamp.append((name, t.data_ptr(), _version(t), tuple(t.shape), t.dtype))
            sample = _sample(t)
            if sample.shape[0] == DIGEST_RUNS:
                runs.setdefault((t.dtype, t.device), []).append(sample)
            elif sample.numel():
                small.setdefault((t.dtype, t.device), []).append(sample.reshape(-1))
        h = hashlib.blake2b(repr(stamp).encode(), digest_size=DIGEST_BYTES)
        for parts in (runs, small):
            for _, samples in sorted(parts.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
                # Raw bytes whatever the dtype (numpy has no bfloat16): one gather per dtype, reinterpreted as uint8.
                h.update(torch.cat(samples).cpu().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def weights_hash(model: torch.nn.Module | Any, *, full: bool = False) -> str:
    """BLAKE2b hex digest (32 characters) of a module's parameters and buffers: names, dtypes, shapes and bytes.

    Args:
        model: a ``torch.nn.Module`` or a :class:`sur_lab.models.LoadedModel` (its ``model``).
        full: hash every byte again even when :func:`weights_digest` is unchanged (a ``.data`` write confined to
            elements between its samples).

    Returns:
        The digest of the content (equal weights give equal hashes, wherever they are stored); cached per module
        under its :func:`weights_digest`, so an in-place update (``p.data.copy_``, ``p.data.add_``,
        ``load_state_dict``, ``copy_`` under ``torch.inference_mode``, ``assign=True``, an optimizer step) is hashed
        again.

    Raises:
        ValueError: naming ``model`` when it is neither a module nor a LoadedModel.
    """
    module = _module_of(model)
    key = weights_digest(module)
    hit = _WEIGHTS_CACHE.get(module)
    if hit is not None and hit[0] == key and not full:
        return hit[1]
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    with torch.no_grad():
        for name, t in _tensors(module):
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            flat = t.detach().reshape(-1).contiguous().cpu()
            # Raw bytes whatever the dtype (numpy has no bfloat16): reinterpret as uint8 without copying.
            if flat.numel():
                h.update(flat.view(torch.uint8).numpy().data)  # a buffer view: no copy of the bytes
    digest = h.hexdigest()
    _WEIGHTS_CACHE[module] = (key, digest)
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
    """The dtype a run used and why, for its "This run" line: ``"bfloat16 (auto: CUDA computes bfloat16 natively)"``,
    ``"float32 (auto: the CPU has no native bfloat16 arithmetic ...)"`` (the dtype named once), or ``"float32
    (requested)"``.

    Args:
        lm: a :class:`sur_lab.models.LoadedModel`.
    """
    name = str(lm.dtype).removeprefix("torch.")
    reason = dtype_reason(lm)
    # "auto: float32; the CPU ..." -> "float32 (auto: the CPU ...)": the dtype is named once.
    head = f"auto: {name}"
    if reason.startswith(head):
        reason = "auto: " + reason[len(head):].lstrip(",; ")
    return f"{name} ({reason})"


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


__all__ = ["DIGEST_BYTES", "DIGEST_RUNS", "DIGEST_SAMPLES", "describe", "device_name", "digest", "dtype_line",
           "dtype_reason", "first_difference", "model_fingerprint", "versions", "weights_digest", "weights_hash"]
