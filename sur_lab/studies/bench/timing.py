"""Refresh timings of the executors (section 4.4, appendix 13.3): the interleaved timer (:func:`time_interleaved`),
the matched-work grid (:func:`refresh_grid`, Table 18 analogue), packed refresh vs Replay at budgets b
(:func:`replay_sweep`) and one layer's attention alone per backend (:func:`attention_only`, Table 19 analogue).

Wall time is ``time.perf_counter`` around the call, after ``torch.cuda.synchronize`` on CUDA; nothing here asserts a
time.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from sur_lab.budget import Support, allowance, spread_support
from sur_lab.cache_ops import clone_cache, slice_rows, to_tensors
from sur_lab.edits import EditedContext
from sur_lab.executors import executor_consumes_input, get_executor, packed, replay
from sur_lab.executors.kernels import (
    build_indexed_attention_plan,
    causal_attention_oracle,
    indexed_attention,
    onepass_available,
    uses_triton,
)
from sur_lab.executors.packed import causal_pair_count
from sur_lab.forward import forward_tokens
from sur_lab.models import LoadedModel
from sur_lab.studies.bench.cases import BenchContext, matched_support

#: Executors of the matched-work grid timed on every device (appendix 13.3).
CPU_EXECUTORS = ("sequential", "direct-sequential", "one-shot", "packed-sdpa", "packed-flex", "packed-cpp")
#: Executors timed only on CUDA (on a CPU the Triton interpreter is a correctness tool, not a timing).
GPU_ONLY_EXECUTORS = ("packed-triton",)
#: Grid pseudo-executor: a plain transformers forward of B contiguous tokens appended to an (N - B)-row cache.
APPEND_FORWARD = "append-forward"

__all__ = [
    "APPEND_FORWARD",
    "CPU_EXECUTORS",
    "GPU_ONLY_EXECUTORS",
    "append_forward_task",
    "attention_only",
    "compare_outputs",
    "executor_task",
    "refresh_grid",
    "replay_sweep",
    "time_interleaved",
    "timed_executors",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    tasks: dict[tuple, Callable[[], object] | tuple[Callable[[], object], Callable[[object], object]]],
    *,
    warmups: int,
    repeats: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    progress: Callable[[Iterable], Iterable] | None = None,
) -> pd.DataFrame:
    """Time every task ``repeats`` times in randomly interleaved rounds after ``warmups`` untimed rounds.

    Each round calls every task once in a fresh random order (a seeded permutation), so slow drifts of a shared
    machine spread over all tasks instead of biasing one. The task's return value is dropped after the clock stops.

    Args:
        tasks: key tuple -> zero-argument callable, or ``(setup, call)``: ``setup()`` runs untimed just before the
            clock starts and its result is passed to ``call`` (a fresh cache for an in-place executor).
        warmups: untimed rounds (>= 0).
        repeats: timed rounds (>= 1).
        seed: permutation seed.
        device: synchronized before each clock read when CUDA.
        progress: optional iterable wrapper (e.g. ``tqdm``) for the rounds.

    Returns:
        One row per timed call: ``key`` (the tuple), ``rep``, ``order`` (position in its round), ``ms``.

    Raises:
        ValueError: naming ``warmups`` or ``repeats`` when out of range.
    """
    if warmups < 0:
        raise ValueError(f"warmups={warmups} must be >= 0")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    device = torch.device(device)
    keys = list(tasks)
    rng = np.random.default_rng(seed)
    rows = []
    rounds = range(warmups + repeats)
    for round_index in progress(rounds) if progress else rounds:
        for order, i in enumerate(rng.permutation(len(keys))):
            key = keys[i]
            task = tasks[key]
            if isinstance(task, tuple):
                setup, call = task
                arg = setup()
                _sync(device)
                t0 = time.perf_counter()
                result = call(arg)
            else:
                arg = None
                _sync(device)
                t0 = time.perf_counter()
                result = task()
            _sync(device)
            ms = (time.perf_counter() - t0) * 1e3
            del result, arg
            if round_index >= warmups:
                rows.append({"key": key, "rep": round_index - warmups, "order": order, "ms": ms})
    return pd.DataFrame(rows)


def timed_executors(executors: Sequence[str], device: torch.device | str) -> tuple[list[str], list[str]]:
    """Split ``executors`` into those timed on ``device`` and those skipped (Triton executors off CUDA)."""
    device = torch.device(device)
    timed = [e for e in executors if device.type == "cuda" or not e.startswith("packed-triton")]
    return timed, [e for e in executors if e not in timed]


def executor_task(lm: LoadedModel, name: str, shift_cache: DynamicCache, edit: EditedContext, support: Support):
    """A :func:`time_interleaved` task running executor ``name``; in-place executors get a fresh copy of
    ``shift_cache`` in the untimed setup (``shift_cache`` itself is never modified)."""
    fn = get_executor(name)
    if executor_consumes_input(name):
        return (lambda: clone_cache(shift_cache), lambda cache: fn(lm, cache, edit, support))
    return lambda: fn(lm, shift_cache, edit, support)


def append_forward_task(lm: LoadedModel, shift_cache: DynamicCache, edit: EditedContext, num_selected: int):
    """The arithmetic floor of a B-token refresh as a :func:`time_interleaved` task: a plain transformers forward
    (``model(input_ids, cache)``) of the B contiguous edited tokens ``[N - B, N)`` appended to a copy of rows
    ``[0, N - B)`` of ``shift_cache`` (the copy is the untimed setup). Its cache append is transformers' own."""
    n = edit.edited_len
    ids = edit.edited_ids[n - num_selected :].to(lm.device)
    return (lambda: slice_rows(shift_cache, 0, n - num_selected),
            lambda cache: forward_tokens(lm, ids, cache, logits="none"))


def compare_outputs(out: DynamicCache, reference: DynamicCache, shift_cache: DynamicCache, absolute: np.ndarray):
    """Selected-row agreement with a reference and bitwise preservation of the other rows.

    Returns:
        dict with ``selected_max_abs`` (largest |K - K_ref|, |V - V_ref| over selected rows and layers, float64) and
        ``unselected_identical`` (every non-selected row of every layer bitwise that of ``shift_cache``).
    """
    idx = torch.as_tensor(absolute, dtype=torch.long)
    worst, identical = 0.0, True
    for (k, v), (kr, vr), (ks, vs) in zip(to_tensors(out), to_tensors(reference), to_tensors(shift_cache)):
        i = idx.to(k.device)
        for a, b in ((k, kr), (v, vr)):
            worst = max(worst, (a[:, :, i].double() - b[:, :, i].double()).abs().max().item() if len(idx) else 0.0)
        keep = torch.ones(k.shape[2], dtype=torch.bool, device=k.device)
        keep[i] = False
        identical &= torch.equal(k[:, :, keep], ks[:, :, keep]) and torch.equal(v[:, :, keep], vs[:, :, keep])
    return {"selected_max_abs": worst, "unselected_identical": bool(identical)}


def refresh_grid(
    lm: LoadedModel,
    contexts: Sequence[BenchContext],
    *,
    num_selected: int = 64,
    num_intervals: Sequence[int] = (1, 4, 16),
    executors: Sequence[str] = CPU_EXECUTORS,
    warmups: int = 10,
    repeats: int = 20,
    seed: int = 0,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Matched-work refresh timings (Table 18 analogue) for every context, R and executor.

    Before timing, each (N, R, executor) runs once untimed (this call compiles flex) and is checked against the
    ``"sequential"`` reference executor.

    Args:
        lm: the model.
        contexts: prepared context lengths (:func:`~sur_lab.studies.bench.cases.prepare_context`).
        num_selected: B.
        num_intervals: the R values; each must divide B.
        executors: registered executor names (in-place forms get a fresh copy per call, untimed); Triton ones are
            skipped off CUDA (:func:`timed_executors`); :data:`APPEND_FORWARD` adds the arithmetic floor (R = 1).
        warmups, repeats: as :func:`time_interleaved` (per context length, all R and executors interleaved).
        seed: interleaving seed.
        progress: optional iterable wrapper for the rounds.

    Returns:
        ``(timings, checks)``: timings has one row per call (``context_len, num_intervals, executor, rep, order, ms,
        pairs`` with pairs = M(U)); checks has one row per cell with ``first_call_ms``, ``selected_max_abs`` vs
        sequential and ``unselected_identical``.

    Raises:
        ValueError: see :func:`matched_support` and :func:`time_interleaved`; unknown executor names.
    """
    timed, _ = timed_executors(executors, lm.device)
    timed = [e for e in timed if e != APPEND_FORWARD]
    floor = APPEND_FORWARD in executors
    fns = {name: get_executor(name) for name in dict.fromkeys(["sequential", *timed])}
    timings, checks = [], []
    for ctx in contexts:
        supports = {r: matched_support(ctx.context_len, ctx.edit.prefix_len, num_selected, r) for r in num_intervals}
        tasks = {}
        for r, support in supports.items():
            absolute = support.absolute(ctx.edit.prefix_len)
            reference = fns["sequential"](lm, ctx.shift, ctx.edit, support)
            for name in timed:
                given = clone_cache(ctx.shift) if executor_consumes_input(name) else ctx.shift
                _sync(lm.device)
                t0 = time.perf_counter()
                out = fns[name](lm, given, ctx.edit, support)
                _sync(lm.device)
                first_ms = (time.perf_counter() - t0) * 1e3
                checks.append(
                    {
                        "context_len": ctx.context_len,
                        "num_intervals": r,
                        "executor": name,
                        "first_call_ms": first_ms,
                        "pairs": int(np.sum(absolute + 1)),
                        **compare_outputs(out, reference, ctx.shift, absolute),
                    }
                )
                del out, given
                tasks[(name, r)] = executor_task(lm, name, ctx.shift, ctx.edit, support)
            del reference
        if floor:  # independent of R: timed once per N, reported under R = 1
            tasks[(APPEND_FORWARD, 1)] = append_forward_task(lm, ctx.shift, ctx.edit, num_selected)
        df = time_interleaved(tasks, warmups=warmups, repeats=repeats, seed=seed, device=lm.device, progress=progress)
        df["executor"] = [k[0] for k in df["key"]]
        df["num_intervals"] = [k[1] for k in df["key"]]
        df["context_len"] = ctx.context_len
        n = ctx.context_len
        df["pairs"] = [
            int(np.sum(supports[r].absolute(ctx.edit.prefix_len) + 1)) if e != APPEND_FORWARD
            else int(np.sum(np.arange(n - num_selected, n) + 1))
            for e, r in zip(df["executor"], df["num_intervals"])
        ]
        timings.append(df.drop(columns="key"))
    cols = ["context_len", "num_intervals", "executor", "rep", "order", "ms", "pairs"]
    return pd.concat(timings, ignore_index=True)[cols], pd.DataFrame(checks)


def replay_sweep(
    lm: LoadedModel,
    ctx: BenchContext,
    *,
    budgets: Sequence[float] = (1, 2, 5, 10, 20),
    num_intervals: int = 16,
    executors: Sequence[str] = ("packed-sdpa", "packed-sdpa-split"),
    full_support: bool = True,
    warmups: int = 1,
    repeats: int = 5,
    seed: int = 0,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> pd.DataFrame:
    """Packed refresh at budgets b (% of the suffix) beside Replay, interleaved, on one context.

    Args:
        lm: the model.
        ctx: the prepared context (S = N - p suffix tokens).
        budgets: b values in percent; B = B(S, b) (Eq. 3), placed by :func:`sur_lab.budget.spread_support` in ``num_intervals``
            (at most B).
        num_intervals: R of each support (fewer when B < R).
        executors: packed executor names, each timed at every budget.
        full_support: also time every executor at b = 100 % (all S positions: an exact Replay on that executor's
            own attention path, the baseline of ``fraction_of_packed_replay`` in
            :func:`~sur_lab.studies.bench.report.replay_medians`).
        warmups, repeats, seed, progress: as :func:`time_interleaved`.

    Returns:
        One row per timed call: ``method`` ("Replay", transformers' full suffix recompute, or an executor name),
        ``budget_pct`` (100 for Replay), ``num_selected``, ``num_intervals``, ``pairs`` (causal query-key pairs per
        head, ``sum(u + 1)`` over the absolute positions recomputed: the numerator of Eq. 18), ``rep``, ``ms``.
    """
    fns = {name: get_executor(name) for name in executors}  # unknown names fail here, before any timing
    s, p = ctx.edit.suffix_len, ctx.edit.prefix_len
    full = Support.full(s)
    tasks: dict[tuple, Callable[[], object]] = {
        ("Replay", 100.0, s, 1, causal_pair_count(full.absolute(p))): lambda: replay(lm, ctx.shift, ctx.edit)
    }
    for b in dict.fromkeys([*map(float, budgets), *([100.0] if full_support else [])]):
        B = allowance(s, b)
        support = full if b == 100.0 else spread_support(s, B, min(num_intervals, B))
        pairs = causal_pair_count(support.absolute(p))
        for name in fns:
            tasks[(name, b, support.size, support.num_intervals, pairs)] = executor_task(
                lm, name, ctx.shift, ctx.edit, support
            )
    df = time_interleaved(tasks, warmups=warmups, repeats=repeats, seed=seed, device=lm.device, progress=progress)
    for i, col in enumerate(("method", "budget_pct", "num_selected", "num_intervals", "pairs")):
        df[col] = [k[i] for k in df["key"]]
    df["context_len"] = ctx.context_len
    cols = ["context_len", "method", "budget_pct", "num_selected", "num_intervals", "pairs", "rep", "ms"]
    return df.drop(columns="key")[cols]


def attention_only(
    context_len: int,
    num_intervals: int,
    *,
    num_selected: int = 64,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
    backends: Sequence[str] = ("sdpa-repeat", "sdpa-gqa", "flex", "triton"),
    positions: Sequence[int] | np.ndarray | None = None,
    warmups: int = 10,
    repeats: int = 30,
    seed: int = 0,
) -> pd.DataFrame:
    """Attention-only timing with resident operands (Table 19 analogue; defaults: Qwen3-8B heads, BF16).

    q ``[1, Hq, B, d]``, k and v ``[1, Hkv, N, d]`` stay on ``device``; the support is :func:`matched_support` with a
    16-token prefix, or the given absolute ``positions``. Masks, block masks, key splits and plans are built before
    timing (excluded); the first call of each backend is timed on its own (``first_call_s``: compilation for
    ``"flex"``) and excluded from the medians; each timed call includes dispatch and output allocation. Backends:

    * ``"sdpa-repeat"``: K/V heads repeated, boolean mask (what transformers' SDPA wrapper does with a mask);
    * ``"sdpa-gqa"``: one masked call with ``enable_gqa=True`` (the ``packed-sdpa`` path);
    * ``"split"``: the key split of ``packed-sdpa-split`` (:func:`sur_lab.executors.packed.split_segments`; CPU);
    * ``"onepass"``: the one-pass C++ kernel of ``packed-cpp`` (:mod:`sur_lab.executors.kernels.onepass`; CPU, skipped
      where it cannot be built);
    * ``"flex"``: compiled FlexAttention with the O(B) block mask (``packed-flex``); ``"flex-eager"``: the same call
      uncompiled;
    * ``"triton"``: the indexed-attention kernel (skipped where :func:`sur_lab.executors.kernels.uses_triton` is
      False); on a CPU it runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before ``sur_lab`` was
      imported), and its row is then named ``"triton-interpreter"``: a timing of the interpreter, not of the kernel;
    * ``"unmasked"``: the throughput floor, one unmasked call over the same row-key pairs: the B packed rows against
      the first ``round(M(U) / B)`` keys (on a CPU torch's flash op with the GQA group folded into the rows, so each
      key is read once per KV head and query block; elsewhere SDPA with ``enable_gqa``).

    Every output but the floor's is first compared with the FP64 oracle.

    Returns:
        One row per backend: ``backend, context_len, num_intervals, num_selected, pairs`` (M(U) per head),
        ``work_over_pairs`` (row-key pairs the backend computes, padding and masked ones included, over M(U); NaN
        where not modelled), ``median_us``, ``first_call_s``, ``max_abs_vs_fp64`` (NaN for the floor).

    Raises:
        ValueError: see :func:`matched_support`, :func:`time_interleaved`; ``positions`` outside ``[0, context_len)``.
    """
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    if positions is None:
        absolute = matched_support(context_len, 16, num_selected, num_intervals).absolute(16)
    else:
        absolute = np.asarray(positions, dtype=np.int64)
        if absolute.size == 0 or absolute.min() < 0 or absolute.max() >= context_len:
            raise ValueError(f"positions must be non-empty and lie in [0, context_len={context_len})")
        num_selected, num_intervals = absolute.size, int(1 + np.sum(np.diff(absolute) > 1))
    b = num_selected
    q = torch.randn((1, num_heads, b, head_dim), generator=gen).to(device, dtype)
    k = torch.randn((1, num_kv_heads, context_len, head_dim), generator=gen).to(device, dtype)
    v = torch.randn((1, num_kv_heads, context_len, head_dim), generator=gen).to(device, dtype)
    positions = torch.from_numpy(absolute).to(device)
    kv_end = int(absolute[-1]) + 1
    pairs = int(np.sum(absolute + 1))
    mask = packed.packed_causal_mask(positions, context_len)
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5
    on_cpu = device.type == "cpu"
    calls: dict[tuple, Callable[[], torch.Tensor]] = {}
    work: dict[str, float] = {}
    if "sdpa-repeat" in backends:
        calls[("sdpa-repeat",)] = lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask
        )
        work["sdpa-repeat"] = b * context_len
    if "sdpa-gqa" in backends:
        calls[("sdpa-gqa",)] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        work["sdpa-gqa"] = b * context_len
    if "split" in backends and on_cpu:
        split = packed._make_attention("sdpa", positions, kv_end, dtype, flex_compile=False, sdpa_split=True,
                                       num_kv_groups=group)
        if split.segments is not None:
            calls[("split",)] = lambda: split.attend(q, k, v, scale)
            work["split"] = sum((b - seg.call_row) * (seg.key_end - seg.key_start) for seg, _ in split.segments)
    if "onepass" in backends and on_cpu and onepass_available():
        onepass = packed._make_attention("cpp", positions, kv_end, dtype, flex_compile=False, num_kv_groups=group)
        bounds = onepass.plan.bounds.numpy()
        first = np.searchsorted(absolute, bounds[:-1], side="left")
        calls[("onepass",)] = lambda: onepass.attend(q, k, v, scale)
        work["onepass"] = int(np.sum((b - first) * np.diff(bounds)))
    if "flex" in backends or "flex-eager" in backends:
        block_mask = packed.flex_block_mask(positions, context_len)
    if "flex" in backends:
        flex = packed._flex_attention(True)
        calls[("flex",)] = lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    if "flex-eager" in backends:
        flex_eager = packed._flex_attention(False)
        calls[("flex-eager",)] = lambda: flex_eager(q, k, v, block_mask=block_mask, enable_gqa=True)
    if "triton" in backends and uses_triton(device):
        # On a CPU only Triton's interpreter runs the kernel (TRITON_INTERPRET=1 before sur_lab was imported): its row
        # is named apart, as it times the interpreter, not the GPU kernel.
        plan = build_indexed_attention_plan(positions)
        calls[("triton" if device.type == "cuda" else "triton-interpreter",)] = (
            lambda: indexed_attention(q, k, v, plan))
    if "unmasked" in backends:
        keys = max(1, round(pairs / b))
        kf, vf = k[:, :, :keys], v[:, :, :keys]
        if on_cpu and packed._has_cpu_flash():
            folded = q.reshape(1, num_kv_heads, group, b, head_dim).transpose(2, 3).reshape(1, num_kv_heads, -1, head_dim)
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            calls[("unmasked",)] = lambda: flash(folded, kf, vf, scale=scale)[0]
        else:
            calls[("unmasked",)] = lambda: F.scaled_dot_product_attention(q, kf, vf, enable_gqa=True)
        work["unmasked"] = b * keys
    oracle = causal_attention_oracle(q, k, v, positions)
    errors, first_s = {}, {}
    for key, fn in calls.items():  # the first call (compiles flex, builds the C++ kernel's plan caches), untimed
        _sync(device)
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # eager Flex is measured on purpose; torch warns once per process
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = fn()
        _sync(device)
        first_s[key[0]] = time.perf_counter() - t0
        errors[key[0]] = float("nan") if key[0] == "unmasked" else (out.double() - oracle).abs().max().item()
    del oracle
    df = time_interleaved(calls, warmups=warmups, repeats=repeats, seed=seed, device=device)
    df["backend"] = [key[0] for key in df["key"]]
    out = df.groupby("backend", sort=False)["ms"].median().mul(1e3).rename("median_us").reset_index()
    out["max_abs_vs_fp64"] = out["backend"].map(errors)
    out["first_call_s"] = out["backend"].map(first_s)
    out["work_over_pairs"] = out["backend"].map(lambda name: work.get(name, float("nan")) / pairs)
    out = out.assign(context_len=context_len, num_intervals=num_intervals, num_selected=b, pairs=pairs)
    return out[["backend", "context_len", "num_intervals", "num_selected", "pairs", "work_over_pairs", "median_us",
                "first_call_s", "max_abs_vs_fp64"]]
