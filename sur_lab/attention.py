"""Per-call attention routing: one dispatching attention function per model, so that nothing a forward reads is
switched while other threads run forwards on the same model.

transformers' attention modules look their function up at every call by ``config._attn_implementation``, a field of
the model's *shared* config. Switching it for the duration of a call (as the packed executor once did) routes every
forward that runs meanwhile in another thread into the wrong function, and two overlapping switches can restore the
wrong value and leave the model switched for good. Instead, :func:`install_router` switches a model *once* to a
dispatching implementation named ``"sur_lab|<native>"`` (``"sur_lab|sdpa"``, ``"sur_lab|eager"``) and registers, for
that name, the native mask function (so ordinary forwards build exactly the masks they built before) and a router that
decides per call:

1. an ``attention_mask`` that is a :class:`RoutedMask` (the packed executor's per-refresh plan, built per call and
   passed down the layers like a mask) computes its own attention;
2. otherwise, a hook installed by :func:`attention_hook` *in the calling context* for this model (a
   ``contextvars.ContextVar``: per thread, per asyncio task) wraps the native function
   (:class:`sur_lab.studies.theory.AttentionCapture` records queries this way);
3. otherwise the model's own function runs with the arguments unchanged: ordinary forwards are bitwise what they are
   without the router.

The install is idempotent, takes a lock, and is the only write to the config; a forward that reads the config while it
happens gets the native function either way. A user who sets ``config._attn_implementation`` (or calls
``model.set_attn_implementation``) afterwards simply removes the router; the next packed refresh installs it again over
the new native implementation. Changing the implementation *while* forwards run in other threads is not supported
(transformers itself reads the field mid-forward).

Source: thread-safety requirement of issue 24 (several threads repairing and answering on one model); see
``docs/threads.md``.
"""

from __future__ import annotations

import contextvars
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: Prefix of the dispatching attention implementation a routed model's config names (``"sur_lab|sdpa"``).
ROUTER_PREFIX = "sur_lab|"

_INSTALL_LOCK = threading.Lock()
#: Attribute (in the model's ``__dict__``) caching the configs a router was installed on.
_CONFIGS_ATTR = "_sur_lab_attention_configs"
_REGISTERED: set[str] = set()
#: Hooks of the current context: a tuple of ``(config ids, hook)`` (innermost last).
_HOOKS: contextvars.ContextVar[tuple[tuple[frozenset[int], Callable[..., Any]], ...]] = contextvars.ContextVar(
    "sur_lab_attention_hooks", default=()
)

__all__ = [
    "ROUTER_PREFIX",
    "RoutedMask",
    "attention_configs",
    "attention_hook",
    "install_router",
    "native_implementation",
]


class RoutedMask:
    """Base class of per-call attention plans passed to the decoder layers in place of ``attention_mask``.

    A routed model's attention calls ``mask(module, query, key, value, **kwargs)`` instead of its own function when the
    mask is an instance: query ``[1, H_q, L, d_h]``, key/value ``[1, H_kv, K, d_h]`` (after the layer's cache update),
    returning ``(output [1, L, H_q, d_h], None)`` as transformers' attention functions do.
    """

    def __call__(self, module: torch.nn.Module, query, key, value, **kwargs: Any):  # pragma: no cover - interface
        raise NotImplementedError


def native_implementation(config: Any) -> str | None:
    """The model's own attention implementation (``"sdpa"``, ``"eager"``, ...), with the router's prefix removed."""
    name = getattr(config, "_attn_implementation", None)
    if isinstance(name, str) and name.startswith(ROUTER_PREFIX):
        return name[len(ROUTER_PREFIX):]
    return name


def attention_configs(model: torch.nn.Module) -> list[Any]:
    """The distinct config objects the model's attention modules read their implementation from (usually one)."""
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(module, "layer_idx") and hasattr(config, "_attn_implementation"):
            configs.setdefault(id(config), config)
    top = getattr(model, "config", None)
    if top is not None:
        configs.setdefault(id(top), top)
    return list(configs.values())


def _native_function(module: torch.nn.Module, native: str | None) -> Callable[..., Any]:
    """The function transformers would call for ``native``: the registered one, or the modeling file's own eager."""
    if native not in (None, "eager"):
        # import cost: transformers.modeling_utils loads ~1,500 modules; `import sur_lab` does not need them
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[native]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(
            f"{type(module).__name__}: its modeling file has no eager_attention_forward, which transformers uses "
            "for attn_implementation='eager'"
        )
    return eager


def _router(native: str | None) -> Callable[..., Any]:
    def route(module, query, key, value, attention_mask, **kwargs):
        if isinstance(attention_mask, RoutedMask):
            return attention_mask(module, query, key, value, **kwargs)
        fn = _native_function(module, native)
        hooks = _HOOKS.get()
        if hooks:
            owner = id(getattr(module, "config", None))
            for configs, hook in reversed(hooks):
                if owner in configs:
                    return hook(fn, module, query, key, value, attention_mask, **kwargs)
        return fn(module, query, key, value, attention_mask, **kwargs)

    route.__name__ = f"sur_lab_route_{native}"
    route.__doc__ = f"Attention router over {native!r} (see :mod:`sur_lab.attention`)."
    return route


def _register(native: str | None) -> str:
    """Register the router and the native mask function under ``ROUTER_PREFIX + native`` (once per process)."""
    name = f"{ROUTER_PREFIX}{native or 'eager'}"
    if name in _REGISTERED:
        return name
    # import cost: as above (AttentionInterface lives in transformers.modeling_utils)
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, _router(native))
    mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(native or "eager")
    if mask is not None:  # an implementation without a mask function (e.g. a kernel) keeps having none
        AttentionMaskInterface.register(name, mask)
    _REGISTERED.add(name)
    return name


def install_router(model: torch.nn.Module) -> None:
    """Switch ``model``'s attention to the dispatching implementation once (idempotent, thread-safe; in place).

    Afterwards ordinary forwards run the model's own attention function with unchanged arguments (bitwise the same
    results), a :class:`RoutedMask` passed as ``attention_mask`` runs its own attention, and :func:`attention_hook`
    applies per calling context. ``config._attn_implementation`` then reads ``"sur_lab|<native>"``;
    :func:`native_implementation` gives the native name.
    """
    configs = model.__dict__.get(_CONFIGS_ATTR)
    if configs is not None and all(_is_routed(c) for c in configs):
        return  # the common case: routed by an earlier call (no module walk, no lock)
    with _INSTALL_LOCK:
        configs = attention_configs(model)
        for config in configs:
            if not _is_routed(config):
                # The internal field, as transformers' own set_attn_implementation does (no recursion into
                # sub-configs). A reader in another thread sees the native name or the router: the same function.
                config._attn_implementation_internal = _register(config._attn_implementation)
        model.__dict__[_CONFIGS_ATTR] = tuple(configs)


def _is_routed(config: Any) -> bool:
    name = getattr(config, "_attn_implementation", None)
    return isinstance(name, str) and name.startswith(ROUTER_PREFIX)


@contextmanager
def attention_hook(model: torch.nn.Module, hook: Callable[..., Any]) -> Iterator[None]:
    """Within this block, and only in the calling context (thread / task), ``model``'s attention calls
    ``hook(fn, module, query, key, value, attention_mask, **kwargs)`` where ``fn`` is the model's own function.

    Other threads' forwards on the same model, and this thread's forwards on other models, are unaffected. Hooks nest
    (the innermost applies). The model is routed first (:func:`install_router`).
    """
    install_router(model)
    configs = frozenset(id(c) for c in model.__dict__[_CONFIGS_ATTR])
    token = _HOOKS.set((*_HOOKS.get(), (configs, hook)))
    try:
        yield
    finally:
        _HOOKS.reset(token)
