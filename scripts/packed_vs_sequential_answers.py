"""Same support, two executors: do the answers agree? (embedded SmolLM2, 4 Erasing-NIAH cases at 512 tokens; issue 13).

    PYTHONPATH=$PWD python scripts/packed_vs_sequential_answers.py
"""
import tempfile
import time
from pathlib import Path

from sur_lab.models import load_model
from sur_lab.sweeps import run_sweep
from sur_lab.studies.niah import build_niah_cases, niah_scorer, parse_niah_answer

lm = load_model()
niah = build_niah_cases(lm.tokenizer, context_lens=(512,), depths=(0.3, 0.7), num_cases=4, seed=0)
cases = [c.sweep_case() for c in niah]
out = {}
for ex in ("sequential", "packed"):
    t = time.perf_counter()
    d = Path(tempfile.mkdtemp()) / ex
    r = run_sweep(lm, cases, ["Re-prefill", "SUR", "SUR-IDF", "Dense tokens"], [2, 5, 20], d, max_new_tokens=16,
                  executor=ex, scorer=niah_scorer, parser=parse_niah_answer, seed=0)
    out[ex] = r
    print(ex, f"{time.perf_counter() - t:.0f} s", flush=True)
a, b = out["sequential"], out["packed"]
m = a[a.budget_pct.notna()].merge(b[b.budget_pct.notna()], on=["case_id", "method", "budget_pct"], suffixes=("_seq", "_packed"))
same = (m.answer_seq == m.answer_packed)
print(f"identical answers: {same.sum()} / {len(m)}; same support: {(m.positions_seq.astype(str) == m.positions_packed.astype(str)).sum()} / {len(m)}")
print(m.loc[~same, ["case_id", "method", "budget_pct", "answer_seq", "answer_packed"]].to_string())
print(m.groupby("method")["tied_units_seq"].describe().to_string())
