"""A correctness gate for a user's own model before trusting partial recompute: :func:`check_model` (issue 27).

Repair is exact only when the model does what the repair math assumes: RoPE applied as rotate-half with the inverse
frequencies the model reports (so Shift, Eq. 2, equals a prefill at the new positions), causal attention that honours
its mask (so recomputing part of a context reads what a prefill reads), and token-local layers outside attention (so
the packed executors equal the interval-wise one). :func:`check_model` tests these on the user's model, in its own
dtype and on its own device, on a short random context, in seconds:

- ``shift_layer0``: Shift's layer-0 keys and values equal a prefill at the new positions;
- ``full_budget``: a repair at a 100 % budget equals Re-prefill (every layer);
- ``packed:<executor>``: each packed executor equals the sequential one on a fragmented support (the refreshed rows);
- ``sync``: :meth:`EditSession.sync` of a rewritten prompt at 100 % equals a clean prefill of it.

Errors are relative Frobenius deviations per layer (keys and values apart, float64 norms), the largest over layers.
Tolerances come from the dtype's rounding (:func:`rounding_tolerance`), not from the model: a structural fault (a RoPE
layout or frequency the model does not report, an attention that ignores its mask) gives errors of order one.

Source: Eq. 2 (Shift), Algorithm 1 step 2 (B = S is Replay), appendix 13.2 (packed equals interval-wise in real
arithmetic), issue 27.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sur_lab.budget import Support
from sur_lab.cache_ops import to_tensors
from sur_lab.edits import token_edit
from sur_lab.executors import get_executor, reprefill
from sur_lab.forward import prefill
from sur_lab.models import LoadedModel, as_loaded_model
from sur_lab.repair import prepare, repair
from sur_lab.session import EditSession, register_model_check
from sur_lab.sync import SyncPolicy

#: Executors compared with ``"sequential"`` by default (the packed default and its one-call SDPA form).
DEFAULT_EXECUTORS = ("packed", "packed-sdpa")
#: Storage roundings allowed per layer traversed (random walk over the layers, :func:`rounding_tolerance`).
STORAGE_ULPS = 8
#: Accumulation roundings allowed per sqrt(dot-product length x layers) (:func:`rounding_tolerance`).
ACCUMULATION_ULPS = 4


class ModelCheckError(RuntimeError):
    """Raised by :func:`check_model` (``strict=True``) naming the checks the model failed; ``.report`` holds the
    :class:`ModelCheckReport`."""

    def __init__(self, report: ModelCheckReport) -> None:
        super().__init__(f"the model failed {', '.join(report.failures)}; repair would not be exact:\n{report}")
        self.report = report


@dataclass(frozen=True)
class CheckResult:
    """One check of :func:`check_model`.

    Attributes:
        name: ``shift_layer0``, ``full_budget``, ``packed:<executor>`` or ``sync``.
        passed: ``error <= tolerance``.
        error: the largest relative deviation over layers (keys and values apart), dimensionless.
        tolerance: the dtype's rounding allowance for this comparison (:func:`rounding_tolerance`).
        detail: what was compared.
    """

    name: str
    passed: bool
    error: float
    tolerance: float
    detail: str


@dataclass(frozen=True)
class ModelCheckReport:
    """The outcome of :func:`check_model`: one :class:`CheckResult` per check."""

    model: str
    dtype: str
    device: str
    num_tokens: int
    results: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> tuple[str, ...]:
        """Names of the failed checks."""
        return tuple(r.name for r in self.results if not r.passed)

    def __str__(self) -> str:
        head = f"check_model {self.model} ({self.dtype}, {self.device}, {self.num_tokens} tokens): " + (
            "passed" if self.passed else f"FAILED {', '.join(self.failures)}")
        rows = [f"  {'ok  ' if r.passed else 'FAIL'} {r.name:<20} error {r.error:.3g} <= tol {r.tolerance:.3g}? "
                f"{r.detail}" for r in self.results]
        return "\n".join([head, *rows])


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2 of a floating dtype (2^-53 for float64, 2^-24 for float32, 2^-8 for bfloat16, 2^-11 float16)."""
    return torch.finfo(dtype).eps / 2


def accumulation_roundoff(dtype: torch.dtype, device: torch.device) -> float:
    """Unit roundoff of the dtype GEMMs accumulate in: float64 for float64; TF32 (2^-11) for float32 on CUDA when
    ``torch.backends.cuda.matmul.allow_tf32`` is on; float32 otherwise (bf16 / fp16 GEMMs accumulate in float32)."""
    if dtype == torch.float64:
        return unit_roundoff(torch.float64)
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return 2.0**-11
    return unit_roundoff(torch.float32)


def rounding_tolerance(dtype: torch.dtype, device: torch.device, layers: int, width: int) -> float:
    """Relative deviation allowed between two computations of the same K/V that differ only in rounding.

    ``STORAGE_ULPS · u · sqrt(L) + ACCUMULATION_ULPS · u_acc · sqrt(L · K)``: every layer stores its activations in
    the model dtype (one rounding of unit roundoff u each, accumulating as a random walk over the L layers traversed),
    and its GEMMs sum dot products of length up to K in the accumulation dtype (u_acc, :func:`accumulation_roundoff`;
    a random walk over K terms per layer). Flash-attention's tests use the same two parts: a reference's own error
    and a rounding floor.

    Args:
        dtype: the model's parameter dtype; device: its device.
        layers: layers traversed, L >= 1.
        width: the longest dot product, K (the larger of hidden and intermediate size).
    """
    u, u_acc = unit_roundoff(dtype), accumulation_roundoff(dtype, torch.device(device))
    return STORAGE_ULPS * u * math.sqrt(layers) + ACCUMULATION_ULPS * u_acc * math.sqrt(layers * width)


def layer0_tolerance(dtype: torch.dtype, num_tokens: int) -> float:
    """Relative deviation allowed between Shift's layer-0 keys and a prefill's: a few roundings to the key dtype,
    plus transformers' RoPE angles formed in float32 (``position · inv_freq``, an error of up to
    ``position · 2^-24`` radians, inv_freq <= 1) on both sides."""
    return STORAGE_ULPS * unit_roundoff(dtype) + 2 * num_tokens * unit_roundoff(torch.float32)


def _rel(a, b, rows: np.ndarray | slice | None = None, layers: int | None = None) -> float:
    """Largest relative Frobenius deviation of keys or values over layers (float64 norms), on ``rows``."""
    rows = slice(None) if rows is None else rows
    if isinstance(rows, np.ndarray):
        rows = torch.from_numpy(rows)
    worst = 0.0
    pairs = list(zip(to_tensors(a), to_tensors(b)))[: layers or None]
    for (ka, va), (kb, vb) in pairs:
        for x, y in ((ka, kb), (va, vb)):
            x, y = x[:, :, rows].double(), y[:, :, rows].double()
            scale = y.norm().item()
            if scale > 0:
                worst = max(worst, (x - y).norm().item() / scale)
            elif x.norm().item() > 0:
                worst = math.inf
    return worst


def check_model(
    lm_or_model, tokenizer=None, *, strict: bool = False, num_tokens: int = 48, seed: int = 0,
    executors: Sequence[str] = DEFAULT_EXECUTORS,
) -> ModelCheckReport:
    """Check that budgeted repair is exact on this model, in its own dtype and on its own device (issue 27).

    Runs the four checks of the module docstring on ``num_tokens`` random token ids (a deletion of a sixth of them,
    then a prompt rewrite with a deletion, a replacement, an insertion and an append for ``sync``). The model is not
    modified. Takes a few forwards of ``num_tokens`` tokens.

    Args:
        lm_or_model: a :class:`~sur_lab.models.LoadedModel` or a transformers causal LM module in eval mode.
        tokenizer: optional, for a bare module (not needed: the context is random token ids).
        strict: raise :class:`ModelCheckError` naming the failed checks instead of returning a failing report.
        num_tokens: context length, tokens (>= 24; longer contexts loosen the layer-0 tolerance, see
            :func:`layer0_tolerance`).
        seed: seed of the random context.
        executors: executor names compared with ``"sequential"`` (registered names).

    Returns:
        :class:`ModelCheckReport` (``.passed``, ``.failures``; ``str()`` prints a table).

    Raises:
        TypeError / ValueError: naming ``lm_or_model`` (see :func:`sur_lab.models.as_loaded_model`), ``num_tokens``
            (not an integer >= 24) or ``executors`` (an unknown name), before any forward.
        ModelCheckError: with ``strict=True``, when a check fails (the message names it and holds the report).
        UnsupportedModelError: for a family repair does not cover.
    """
    lm = as_loaded_model(lm_or_model, tokenizer, name="lm_or_model")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 24:
        raise ValueError(f"num_tokens must be an integer >= 24; got {num_tokens!r}")
    names = tuple(executors)
    for name in names:
        get_executor(name)  # raises naming an unknown executor
    config = lm.model.config
    L = lm.spec.num_layers
    width = max(lm.spec.hidden_size, int(getattr(config, "intermediate_size", 0) or 0))
    dtype, device = lm.dtype, lm.device
    deep = rounding_tolerance(dtype, device, L, width)
    gen = torch.Generator().manual_seed(seed)
    vocab = lm.spec.vocab_size
    ids = torch.randint(0, vocab, (num_tokens,), generator=gen)
    query = torch.randint(0, vocab, (4,), generator=gen)
    p, d = num_tokens // 6, num_tokens // 6
    edit = token_edit(ids, p, d, query)
    results = []

    prep = prepare(lm, edit)
    ref = reprefill(lm, edit)
    err = _rel(prep.shift_cache, ref, layers=1)
    tol = layer0_tolerance(dtype, num_tokens)
    results.append(CheckResult("shift_layer0", err <= tol, err, tol,
                               f"Shift of a {d}-token deletion vs a prefill at the new positions, layer 0"))

    err = _rel(repair(lm, prep, "SUR", 100).cache, ref)
    results.append(CheckResult("full_budget", err <= deep, err, deep, "SUR at 100 % vs Re-prefill, every layer"))

    S = edit.suffix_len
    support = Support(np.r_[0:3, S // 3 : S // 3 + 4, S - 2 : S], S)
    rows = support.absolute(p)
    sequential = get_executor("sequential")(lm, prep.shift_cache, edit, support)
    for name in names:
        out = get_executor(name)(lm, prep.shift_cache, edit, support)
        err = _rel(out, sequential, rows)
        results.append(CheckResult(f"packed:{name}" if name != "sequential" else name, err <= deep, err, deep,
                                   f"{name} vs sequential on {support.size} rows in {support.num_intervals} intervals"))

    session = EditSession(lm, method="SUR", budget_pct=100, sync_policy=SyncPolicy(0, 1.0))
    session.append(ids)
    extra = torch.randint(0, vocab, (6,), generator=gen)
    a, b = num_tokens // 4, num_tokens // 2
    new = torch.cat((ids[:a], ids[a + 3 : b], extra[:3], ids[b + 2 :], extra[3:]))  # delete, replace, append
    new = torch.cat((new[:5], extra[:1], new[5:]))  # and an insertion near the start
    record = session.sync(new)
    err = _rel(session.cache, prefill(lm, new)[0])
    results.append(CheckResult("sync", err <= deep and record.path == "repair", err, deep,
                               f"sync of a rewritten prompt at 100 % ({record.path}) vs a clean prefill"))

    report = ModelCheckReport(lm.spec.name, str(dtype).replace("torch.", ""), str(device), num_tokens,
                              tuple(results))
    if strict and not report.passed:
        raise ModelCheckError(report)
    return report


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_model_once(lm: LoadedModel) -> ModelCheckReport:
    """:func:`check_model` with ``strict=True``, run once per model object (and dtype and device): later calls return
    the cached report, or raise again for a model that failed.

    Raises:
        ModelCheckError: as :func:`check_model`.
    """
    key = (lm.dtype, str(lm.device))
    cached = _CHECKED.get(lm.model)
    if cached is None or cached[0] != key:
        cached = (key, check_model(lm))
        _CHECKED[lm.model] = cached
    report = cached[1]
    if not report.passed:
        raise ModelCheckError(report)
    return report


register_model_check(check_model_once)  # EditSession(check=True) runs it (sur_lab.session never imports this module)
