"""Null calibration of the decision layer (issue 36): how often a whole family prints a verdict when nothing differs.

Simulates families shaped like notebook 09's old all-pairs table (38 binary comparisons), notebook 02's SUR against
11 rivals at two budgets (22 binary) and eight continuous comparisons, 48 paired cases each, every arm drawn from the
same distribution (:func:`sur_lab.analysis.decisions.simulate_families`), at several levels alpha. Prints, per shape
and level, the share of families with any "beats" or "loses to" (the family-wise false-positive rate, which Holm keeps
at or below alpha) beside the share with any pointwise interval excluding 0 (the rule before issue 36), and draws
them against alpha into ``docs/assets/decision_calibration.png``.

    PYTHONPATH=. python scripts/decision_calibration.py            # 200 families per shape and level, seed 20260928
    PYTHONPATH=. python scripts/decision_calibration.py --families 50 --out /tmp/calibration.png
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from sur_lab.analysis.decisions import CALIBRATION_SHAPES, proportion_interval, simulate_families

ALPHAS = (0.01, 0.02, 0.05, 0.10, 0.20)
SHAPES = {**{f"{name}, binary": (pairs, "binary") for name, pairs in CALIBRATION_SHAPES.items()},
          "8 comparisons, continuous": (CALIBRATION_SHAPES["02 SUR vs 11 rivals (22)"][:8], "continuous")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", type=int, default=200, help="null families per shape and level")
    parser.add_argument("--units", type=int, default=48, help="paired cases per family")
    parser.add_argument("--n-boot", type=int, default=1_000, help="bootstrap and sign-flip resamples (continuous)")
    parser.add_argument("--seed", type=int, default=20260928)
    parser.add_argument("--out", type=Path, default=Path("docs/assets/decision_calibration.png"))
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = time.perf_counter()
    fig, axes = plt.subplots(1, len(SHAPES), figsize=(4.4 * len(SHAPES), 3.9), sharey=True)
    print(f"{args.families} null families per shape and level, {args.units} paired cases, seed {args.seed}")
    print(f"{'shape':<34} {'alpha':>6} {'decisions':>10} {'95 % CI':>15} {'pointwise':>10}")
    for ax, (name, (pairs, kind)) in zip(axes, SHAPES.items()):
        rates = {"decisions": [], "pointwise": []}
        bars = []
        for alpha in ALPHAS:
            for rule in rates:
                counts = simulate_families(pairs, kind=kind, n_units=args.units, n_families=args.families,
                                           alpha=alpha, n_boot=args.n_boot, seed=args.seed, rule=rule)
                k = int((counts > 0).sum())
                rates[rule].append(k / args.families)
                if rule == "decisions":
                    _, low, high = proportion_interval(k, args.families)
                    bars.append((low, high))
            print(f"{name:<34} {alpha:>6.2f} {rates['decisions'][-1]:>10.3f} "
                  f"{bars[-1][0]:>7.3f}-{bars[-1][1]:<7.3f} {rates['pointwise'][-1]:>10.3f}")
        low, high = np.array(bars).T
        dec = np.array(rates["decisions"])
        ax.plot(ALPHAS, ALPHAS, color="0.4", ls="--", lw=1, label="alpha (the family-wise target)")
        ax.errorbar(ALPHAS, dec, yerr=[dec - low, high - dec], marker="o", color="tab:blue", capsize=3,
                    label="sur_lab.analysis.decisions (exact CI)")
        ax.plot(ALPHAS, rates["pointwise"], marker="s", color="tab:red",
                label="any pointwise interval excludes 0 (before)")
        ax.set_xscale("log")
        ax.set_xticks(ALPHAS, [f"{a:g}" for a in ALPHAS])
        ax.set_title(f"{name} ({len(pairs)})" if "(" not in name else name, fontsize=10)
        ax.set_xlabel("alpha")
    axes[0].set_ylabel("families with any 'beats' or 'loses to'")
    axes[0].set_ylim(0, 1)
    axes[-1].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Null calibration: {args.families} families of {args.units} paired cases per point "
                 f"(seed {args.seed})", fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
