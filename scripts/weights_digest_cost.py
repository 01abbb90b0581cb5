"""Cost of the weights checks on the study model: :func:`sur_lab.fingerprint.weights_digest` per check (the cheap
digest every in-process store keyed on the weights makes, issue 38) against the full content hash it keys
(:func:`sur_lab.fingerprint.weights_hash` with ``full=True``), and the digest after an in-place update.

Prints, for the model's parameters and buffers: the tensor count and bytes, the median and the 90th percentile of
``--repeats`` digest checks (ms), the first check, one full hash (ms), and whether an in-place
``p.data.add_`` on every parameter changed the digest. Run it alone on the machine (``flock -x /work/cpu.lock``) for
numbers to report.

Usage: ``PYTHONPATH=$PWD python scripts/weights_digest_cost.py [--model NAME] [--dtype float32] [--repeats 200]``.
Default model: the embedded Qwen2.5-Coder-0.5B-Instruct (the study model of notebooks 02, 03 and 06).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sur_lab import load_model
from sur_lab.fingerprint import weights_digest, weights_hash
from sur_lab.models import QWEN_MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=QWEN_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    lm = load_model(args.model, dtype=args.dtype)
    module = lm.model
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    size = sum(t.numel() * t.element_size() for _, t in tensors)
    t0 = time.perf_counter()
    first = weights_digest(module)
    first_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        assert weights_digest(module) == first
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    t0 = time.perf_counter()
    weights_hash(module, full=True)
    full_ms = (time.perf_counter() - t0) * 1e3
    with torch.no_grad():
        for p in module.parameters():
            p.data.add_(1e-3)  # an RL weight sync's kind of write: through .data, no version bump
    changed = weights_digest(module) != first
    print(f"model {lm.spec.name} ({args.dtype}): {len(tensors)} tensors, {size / 2**20:.0f} MiB, "
          f"{torch.get_num_threads()} threads")
    print(f"weights_digest: median {statistics.median(times):.2f} ms, p90 {times[int(0.9 * len(times))]:.2f} ms "
          f"over {args.repeats} checks; first check {first_ms:.2f} ms")
    print(f"weights_hash(full=True): {full_ms:.0f} ms")
    print(f"digest changed after p.data.add_ on every parameter: {changed}")


if __name__ == "__main__":
    main()
