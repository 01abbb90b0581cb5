"""Drift of chained deletions in low precision: layer-0 key error against a float64 clean prefill (issue 15).

For bfloat16 and float16 SmolLM2 (or ``--model``), a context of QA passages loses 80 tokens after a short prefix
either as 40 chained deletions of 2 tokens or as one deletion of 80. Compared, on the suffix rows' layer-0 keys
(relative Frobenius error against a float64 prefill of the final tokens, float64 RoPE angles):

* ``session chained`` / ``session single``: :class:`sur_lab.EditSession` with method Shift (re-rotation from each row's
  anchor, float32 arithmetic, one cast);
* ``stored chained`` / ``stored single``: ``cache_ops.shift_cache`` applied to the stored keys each time (what stitching
  Shift caches by hand gives);
* ``Re-prefill``: a prefill of the final tokens in the low-precision dtype.

Usage: ``PYTHONPATH=$PWD python scripts/session_drift.py [--model NAME] [--suffix 320]``. CPU, about a minute.
"""

from __future__ import annotations

import argparse

import torch

from sur_lab import EditSession, load_model
from sur_lab.cache_ops import layer_kv, shift_cache
from sur_lab.forward import prefill
from sur_lab.models import enable_float64_rope
from sur_lab.data.qa import load_qa


def rel_error(keys: torch.Tensor, reference: torch.Tensor) -> float:
    return ((keys.double() - reference).norm() / reference.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prefix", type=int, default=16, help="tokens kept before the deletions")
    parser.add_argument("--suffix", type=int, default=320, help="suffix tokens measured")
    parser.add_argument("--steps", type=int, default=40, help="chained deletions")
    parser.add_argument("--width", type=int, default=2, help="tokens per chained deletion")
    args = parser.parse_args()
    torch.set_num_threads(1)
    examples = load_qa("hotpotqa", split="dev", limit=8)
    text = "\n\n".join(f"Title: {p.title}\n{p.text}" for ex in examples for p in (*ex.supporting, *ex.distractors))
    lm64 = load_model(args.model, dtype=torch.float64)
    enable_float64_rope(lm64.model)
    d = args.steps * args.width
    ids = torch.tensor(lm64.tokenizer(text, add_special_tokens=False)["input_ids"][: args.prefix + d + args.suffix])
    p = args.prefix
    final = torch.cat((ids[:p], ids[p + d :]))
    reference = layer_kv(prefill(lm64, final)[0], 0)[0][:, :, p:]
    print(f"model {lm64.spec.name}; prefix {p}, deleted {d} as {args.steps} x {args.width}, suffix {args.suffix}")
    print(f"{'dtype':10s} {'session chained':>16s} {'session single':>15s} {'stored chained':>15s} "
          f"{'stored single':>14s} {'Re-prefill':>11s}")
    for dtype in (torch.bfloat16, torch.float16):
        lm = load_model(args.model, dtype=dtype)
        errors = {}
        for name, steps, width in (("session chained", args.steps, args.width), ("session single", 1, d)):
            session = EditSession(lm, method="Shift")
            session.append(ids)
            for _ in range(steps):
                session.delete(p, p + width)
            assert torch.equal(session.tokens, final)
            errors[name] = rel_error(layer_kv(session.cache, 0)[0][:, :, p:], reference)
        dirty = prefill(lm, ids)[0]
        for name, steps, width in (("stored chained", args.steps, args.width), ("stored single", 1, d)):
            cache = dirty
            for _ in range(steps):
                cache = shift_cache(cache, p, width, lm.inv_freq)
            errors[name] = rel_error(layer_kv(cache, 0)[0][:, :, p:], reference)
        errors["Re-prefill"] = rel_error(layer_kv(prefill(lm, final)[0], 0)[0][:, :, p:], reference)
        print(f"{str(dtype).removeprefix('torch.'):10s} " + " ".join(f"{v:>{len(k)}.2e}" for k, v in errors.items()))


if __name__ == "__main__":
    main()
