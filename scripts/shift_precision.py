"""Shift's re-rotation error in bfloat16 / float16 against the float64 rotation (issue 16).

Random keys ``[1, 3, 2048, 64]`` (scale 3), RoPE θ = 1e5, offsets Δ = -7, -123, -4001. Prints the max |error| of
``cache_ops.rerotate_keys`` (float32 arithmetic, one cast), of the same rotation done in the key dtype itself (what
Shift did before issue 16), and of one rounding of the exact float64 result (the floor).

Usage: ``PYTHONPATH=$PWD python scripts/shift_precision.py``. CPU, seconds.
"""

from __future__ import annotations

import torch

from sur_lab.cache_ops import rerotate_keys, rotate_half


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    keys64 = torch.randn(1, 3, 2048, 64, generator=gen, dtype=torch.float64) * 3
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    print("| dtype | delta | float32 then one cast | in the key dtype | one rounding of the float64 result |")
    print("|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float16):
        keys = keys64.to(dtype)
        for delta in (-7, -123, -4001):
            emb = torch.cat((delta * inv_freq, delta * inv_freq))
            exact = keys.double() * emb.cos() + rotate_half(keys.double()) * emb.sin()
            ours = rerotate_keys(keys, delta, inv_freq).double()
            naive = (keys * emb.cos().to(dtype) + rotate_half(keys) * emb.sin().to(dtype)).double()
            floor = (exact.to(dtype).double() - exact).abs().max().item()
            print(
                f"| {str(dtype).removeprefix('torch.')} | {delta} | {(ours - exact).abs().max().item():.3e} "
                f"| {(naive - exact).abs().max().item():.3e} | {floor:.3e} |"
            )


if __name__ == "__main__":
    main()
