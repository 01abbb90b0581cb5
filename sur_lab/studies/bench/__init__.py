"""Refresh-time benchmarks of the executors (section 4.4, appendix 13.1 and 13.3), shared by
``notebooks/04_packed_refresh_benchmark.ipynb`` and ``sur-lab bench`` (:mod:`sur_lab.runtime.bench`).

Matched-work grid (Table 18 analogue): a random-token prompt of N + 8 tokens loses 8 tokens after a 16-token prefix
and is Shifted, so N is the edited context (the Shift cache's rows) and the Dirty prefill has N + 8 tokens (the
benchmark's defaults, N = 2040 and 8184, keep it within SmolLM2's max_position_embeddings of 8192). Supports of B
positions in R intervals are placed symmetrically about the middle of the edited context so that the causal pair count
M(U) = sum(u + 1) = B (N + 1) / 2 is identical for every R at a given N (65,568 at N = 2048 and 262,176 at N = 8192 for
B = 64, the paper's values; 65,312 and 261,920 at the defaults). Each executor gets ``warmups`` untimed calls, then
``repeats`` rounds in which every (executor, R) cell of one N is timed once, in a fresh random order per round; we
report medians.
Refresh time covers what the executor does: the output clone, planning, mask construction and all layers; prefill,
Shift, selection and answering are excluded, as is the first call (which compiles flex).

Packed vs Replay: at one context length, supports of B = B(S, b) positions (Eq. 3) in R evenly spaced intervals for
budgets b, timed beside two Replays (full suffix recomputes): transformers' (:func:`sur_lab.executors.replay`: one
forward of the suffix over the prefix cache, whose explicit mask makes CPU flash compute the whole rectangle, about
twice the causal arithmetic) and each packed executor at a 100 % support (every suffix position, an exact Replay on
the packed executor's own attention path: the honest baseline). Eq. 15-18 of appendix 13.1 give the arithmetic
floors: B / S for token-local work (Eq. 15) and the causal-pair fraction, at most min(1, 2B / S) (Eq. 18).

In-place executors (``"<name>-inplace"``) consume their input: each timed call gets a fresh copy of the Shift cache
made before the clock starts (a task's untimed setup), so their time is the refresh without any output clone. The
arithmetic floor of a B-token refresh, :data:`APPEND_FORWARD` in the grid, is a plain transformers forward of the B
contiguous tokens ``[N - B, N)`` appended to a copy of the Shift cache's first N - B rows (the copy untimed).

Preparation overlap (appendix 13.3): :func:`overlap_recovery` times :func:`sur_lab.repair.recover` serially and with
``overlap=True`` on a natural-text edit (SUR needs text boundaries), checking once that support and caches agree
bitwise.

Wall time is ``time.perf_counter`` around the call, after ``torch.cuda.synchronize`` on CUDA. Timings on shared
machines are noisy; nothing here asserts a time.

Modules:

* :mod:`~sur_lab.studies.bench.cases`: the synthetic edits, their Shift caches and the matched supports; the
  natural-text edit of the overlap comparison.
* :mod:`~sur_lab.studies.bench.timing`: the interleaved timer, the matched-work grid, packed vs Replay and the
  attention-only timing.
* :mod:`~sur_lab.studies.bench.recovery`: serial vs overlapped recovery and recovery on real inputs.
* :mod:`~sur_lab.studies.bench.report`: Tables 18-20 and the target ratios.
"""

from sur_lab.budget import spread_support  # noqa: F401 - bench.spread_support: the one owner (tests/test_bench.py)
from sur_lab.studies.bench import cases, recovery, report, timing
from sur_lab.studies.bench.cases import *  # noqa: F403
from sur_lab.studies.bench.timing import *  # noqa: F403
from sur_lab.studies.bench.recovery import *  # noqa: F403
from sur_lab.studies.bench.report import *  # noqa: F403

__all__ = [*cases.__all__, *timing.__all__, *recovery.__all__, *report.__all__]
