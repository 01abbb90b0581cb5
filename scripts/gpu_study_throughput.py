#!/usr/bin/env python
"""Study throughput on a CUDA device (issue 37): records per minute of the Erasing-NIAH sweep with and without exact
prefix sharing, in float32 and in the dtype ``dtype="auto"`` picks there, side by side in one process.

The model has the study model's shape (Qwen2.5-Coder-0.5B-Instruct's ``config.json``, random weights, seed 0) and its
real tokenizer, so cases, prompts and every forward have the study's shapes; answers are not meaningful, but they are
deterministic, so answer agreement between runs says whether a path changes what is computed. No GGUF travels.

Each run is ``niah.STUDY.sweep`` into its own folder (quality endpoints, batched answers); the first run of each dtype
is a warm-up that the timed run repeats in a fresh folder. Prints one row per run: records, wall s,
records per minute, ratio to float32 unshared, peak GPU memory, answer agreement with float32 unshared; and the
agreement of shared against unshared in each dtype. Writes ``throughput.csv`` into ``--out``.

Usage (on the GPU machine; the tokenizer and the 2Wiki filler corpus are passed in, since ../shared does not travel)::

    SUR_LAB_DATA_DIR=.gpu/qa python scripts/gpu_study_throughput.py --tokenizer .gpu/qwen-tok --cases 8 \
        --context-lens 2048 --out $OUT
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch


def build(tokenizer_dir: str, dtype: torch.dtype, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from sur_lab.models import wrap_model

    config = AutoConfig.from_pretrained(tokenizer_dir)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return wrap_model(model, tok, f"qwen2.5-coder-0.5b-random-{str(dtype).split('.')[-1]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="folder with config.json and the tokenizer files")
    p.add_argument("--cases", type=int, default=8)
    p.add_argument("--context-lens", type=int, nargs="+", default=[2048])
    p.add_argument("--executor", default="packed")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="outputs/gpu_study")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    from sur_lab.models import resolve_dtype
    from sur_lab.studies import niah

    auto, reason = resolve_dtype("auto", args.device)
    print(f"dtype='auto' on {args.device}: {auto} ({reason})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, answers = [], {}
    dtypes = [torch.float32] + ([auto] if auto != torch.float32 else [])
    for dtype in dtypes:
        lm = build(args.tokenizer, dtype, args.device)
        for share in (False, True, False, True):  # the first pass warms up (kernels, allocator), the second is timed
            with tempfile.TemporaryDirectory() as tmp:
                if args.device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                records, *_ = niah.STUDY.sweep(lm, preset="default", out=Path(tmp) / "sweep", executor=args.executor,
                                               num_cases=args.cases, context_lens=args.context_lens,
                                               share_prefix=share, progress=False)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else float("nan")
            key = (str(dtype).split(".")[-1], share)
            answers[key] = records.set_index(["case_id", "method", "budget_pct"])["answer"]
            rows.append({"dtype": key[0], "shared_prefix": share, "records": len(records), "wall_s": wall,
                         "records_per_min": 60 * len(records) / wall, "peak_gpu_mib": peak})
        del lm
        if args.device == "cuda":
            torch.cuda.empty_cache()
    table = pd.DataFrame(rows).groupby(["dtype", "shared_prefix"], sort=False).last().reset_index()
    base = table.iloc[0]["records_per_min"]
    table["ratio_vs_float32_unshared"] = table["records_per_min"] / base
    ref = answers[("float32", False)]
    table["answer_agreement_vs_float32_unshared"] = [
        float((answers[(d, s)].reindex(ref.index) == ref).mean()) for d, s in zip(table["dtype"], table["shared_prefix"])]
    pd.set_option("display.width", 200)
    print(table.to_string(index=False, float_format="{:.3f}".format))
    for d in dict.fromkeys(table["dtype"]):
        a, b = answers[(d, False)], answers[(d, True)]
        print(f"{d}: shared vs unshared answers agree on {float((b.reindex(a.index) == a).mean()):.3f} of {len(a)}")
    table.to_csv(out / "throughput.csv", index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
