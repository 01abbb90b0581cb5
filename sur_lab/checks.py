"""Argument checks shared by the public boundaries: token ids and integer counts are refused, never reinterpreted.

A float span is not truncated, a batch of sequences is not flattened, a boolean is not a count: each raises a
``ValueError`` (wrong value) or ``TypeError`` (wrong kind) that names the argument and what is allowed, before any work.
"""

from __future__ import annotations

import numbers
import os
import sys

import numpy as np
import torch

from sur_lab.cache_ops import layer_kv, num_layers


# Modules whose frames belong to a library call: sur_lab itself and torch's decorator wrappers around its functions.
_LIBRARY_MODULES = ("sur_lab.", "torch.utils._contextlib")


def user_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` in the calling function so that the warning names the user's line: the
    first frame outside sur_lab (and outside the ``torch.inference_mode`` / dataclass ``__init__`` wrappers around its
    functions)."""
    frame, level, previous = sys._getframe(1), 1, ""  # the caller (the function that warns) is stacklevel 1
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        library = module == "sur_lab" or module.startswith(_LIBRARY_MODULES)
        # A dataclass's generated __init__ ("<string>") runs __post_init__: it belongs to the library too.
        if not (library or (frame.f_code.co_filename.startswith("<") and previous == "__post_init__")):
            break
        previous, frame, level = frame.f_code.co_name, frame.f_back, level + 1
    return level


def as_count(value, name: str, *, minimum: int = 0) -> int:
    """Return ``value`` as a Python int >= ``minimum``.

    Args:
        value: an ``int`` or numpy integer (booleans, floats, strings and ``None`` are refused).
        name: the argument's name, for the error.
        minimum: smallest allowed value.

    Raises:
        TypeError: naming ``name`` when ``value`` is not an integer (``2.0`` and ``True`` included).
        ValueError: naming ``name`` when ``value < minimum``.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}; got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return int(value)


def as_token_ids(value, name: str, *, allow_empty: bool = False) -> torch.Tensor:
    """Return ``value`` as a 1-D int64 tensor (same device) of token ids (batch size 1).

    Args:
        value: a 1-D sequence or tensor of integer ids; a ``[1, N]`` tensor is accepted as batch size one.
        name: the argument's name, for the error.
        allow_empty: accept zero ids.

    Raises:
        TypeError: naming ``name`` when the ids are not integers (float or bool dtype).
        ValueError: naming ``name`` when the ids hold a batch of more than one sequence, more than two dimensions,
            a negative id, or (unless ``allow_empty``) no id.
    """
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be integer token ids; got a string {value!r}")
    try:
        ids = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{name} must be integer token ids; got {type(value).__name__} ({err})") from None
    if ids.numel() == 0:
        # torch.as_tensor([]) is float32: an empty list carries no dtype to refuse.
        ids = ids.to(torch.long)
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{name} must be integer token ids; got dtype {ids.dtype} (floats are not truncated)")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(
            f"{name} must be 1-D token ids (batch size 1); got shape {tuple(ids.shape)} "
            "(a batch is not flattened into one sequence)"
        )
    if ids.numel() == 0 and not allow_empty:
        raise ValueError(f"{name} must contain at least one token")
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"{name} holds a negative token id {int(ids.min())}; token ids are >= 0")
    return ids.to(torch.long)


def check_vocab(ids: torch.Tensor, vocab_size: int, name: str = "ids") -> None:
    """Refuse token ids outside ``[0, vocab_size)`` (the embedding would raise an IndexError mid-forward).

    Raises:
        ValueError: naming ``name``, the offending id and the vocabulary size.
    """
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds token id {bad} outside the vocabulary [0, {vocab_size})")


def check_batch_one(cache, name: str = "cache") -> None:
    """Refuse a cache whose batch dimension is not 1 (repair covers batch size one, one edited context).

    Raises:
        ValueError: naming ``name`` and the cache's batch size (instead of a shape mismatch deep in attention).
    """
    if num_layers(cache) and layer_kv(cache, 0)[0].shape[0] != 1:
        shape = tuple(layer_kv(cache, 0)[0].shape)
        raise ValueError(f"{name} holds a batch of {shape[0]} sequences (keys shaped {shape}); repair needs batch size 1")


def pid_alive(pid: int) -> bool:
    """Whether a process with id ``pid`` exists on this machine (used to tell a dead writer's leftovers from a live one's).

    A process owned by another user counts as alive (``PermissionError``); no signal is sent (``os.kill(pid, 0)``).
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
