"""Probe that the stale-fact task is answerable and that its edits hurt (issue 26, before the sweep is wired).

For a few cases per family it answers the query after each reference cache and classifies the answer
(:func:`sur_lab.studies.stale_facts.classify_answer`), with the gold value's first-token margin:

- ``Re-prefill``: a prefill of the edited context (should answer the new value V2);
- ``Dirty`` / ``Shift``: :func:`sur_lab.repair.prepare` on the case's edit (for a replacement, Dirty is the context
  before the edit and Shift inserts the new block's rows, as ``Shift (session)``);
- ``Shift (session)``: for a replacement, what an agent's :class:`sur_lab.session.EditSession` holds after
  ``replace(..., method="Shift")`` from a prefill of the context before the edit (its suffix never saw V2);
- ``Erratum``: a prefill of the context before the edit plus the correction note
  (:func:`sur_lab.executors.erratum`);
- ``Before edit``: the context before the edit, unrepaired (answers V1 if the model reads the record at all).

With ``--rates`` it runs the study's own sweep (:meth:`sur_lab.studies.stale_facts.STUDY.sweep`, the records notebook 09
makes) with the references only (Dirty, Shift, Re-prefill, Erratum and the placement control's Shift and Re-prefill)
on ``--cases`` cases per family at the ``default`` preset's depths and distances, and prints each family's stale-answer
rate per reference with its exact interval (:func:`sur_lab.studies.stale_facts.stale_rates`) and the old value's pull
against Re-prefill (:func:`sur_lab.studies.stale_facts.old_margin_differences`): issue 40's check that Shift answers
the old value where the answer-bearing states are stale.

With ``--time`` it also times one case with every method of the issue's list that is registered (references, and each
allocator at each budget, one answer each), to size the presets.

Usage (development data only: the haystack corpus; no held-out file is read)::

    flock -s /work/cpu.lock python scripts/stale_facts_probe.py --model smollm2 --cases 4
    flock -s /work/cpu.lock python scripts/stale_facts_probe.py --model qwen2.5-coder-0.5b --cases 4
    flock -x /work/cpu.lock python scripts/stale_facts_probe.py --model qwen2.5-coder-0.5b --cases 0 --time
    flock -x /work/model.lock python scripts/stale_facts_probe.py --model qwen2.5-coder-0.5b --cases 8 --rates \
        --context-len 384 --families derived_record agent_note --out /tmp/stale-rates
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import torch

from sur_lab.analysis.endpoints import gold_margin
from sur_lab.answer import greedy_answer
from sur_lab.executors import erratum, erratum_note, erratum_note_ids, pre_edit_ids
from sur_lab.forward import prefill
from sur_lab.models import load_model
from sur_lab.repair import prepare, repair
from sur_lab.session import EditSession
from sur_lab.studies.stale_facts import ALL_FAMILIES, FAMILIES, STUDY_ALLOCATORS, answer_class, build_stale_cases


def reference_caches(lm, case):
    """``{method: cache}`` of the probe's reference caches for ``case``."""
    edit = case.edit
    prepared = prepare(lm, edit)
    before_ids = pre_edit_ids(edit, case.inserted_len)
    before = prefill(lm, before_ids)[0]
    note = erratum_note_ids(lm.tokenizer, erratum_note(edit, inserted_len=case.inserted_len))
    caches = {
        "Re-prefill": repair(lm, prepared, "Re-prefill").cache,
        "Dirty": prepared.dirty_cache,
        "Shift": prepared.shift_cache,
        "Erratum": erratum(lm, before, edit, note, inserted_len=case.inserted_len),
        "Before edit": before,
    }
    if case.inserted_len:
        m, p = case.inserted_len, edit.prefix_len
        session = EditSession.from_cache(lm, before, before_ids, method="Shift")
        session.set_query(edit.query_ids)
        session.replace(p - m, p - m + edit.deleted_len, edit.original_ids[p - m : p])
        caches["Shift (session)"] = session.cache
    return caches


def probe(lm, cases, max_new_tokens: int) -> None:
    counts: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    margins: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for case in cases:
        for method, cache in reference_caches(lm, case).items():
            ans = greedy_answer(lm, cache, case.edit.query_ids, max_new_tokens=max_new_tokens)
            label = answer_class(case, ans.text)
            group = case.family + ("" if case.key == case.edited_key else " (untouched key)")
            counts[(group, method)][label] += 1
            margins[(group, method)].append(gold_margin(ans.first_token_logits, case.gold_token))
            print(f"{case.case_id:16s} {group:32s} {method:16s} {label:10s} {ans.text!r:36s} "
                  f"gold={case.gold} old={case.old}")
    print("\nfamily                           method            correct stale mixed distractor wrong  median margin")
    for (group, method), c in sorted(counts.items()):
        print(f"{group:32s} {method:16s} {c['correct']:7d} {c['stale']:5d} {c['mixed']:5d} {c['distractor']:10d} "
              f"{c['wrong']:5d}  {np.median(margins[(group, method)]):+.2f}")


def time_one_case(lm, case, budgets, max_new_tokens: int) -> None:
    """Wall and CPU time of one case with the issue's method list (registered allocators; the others at the median
    allocator time), one answer and one continuation NLL per method (as a sweep record scores them).

    CPU time (``time.process_time``, all threads of this process) is what the case costs on an idle machine with
    ``--threads`` threads' worth of cores when the machine is shared (wall time then includes waiting for a core).
    """
    from sur_lab.allocators import ALLOCATORS
    from sur_lab.answer import continuation_nll

    clocks = (time.perf_counter, time.process_time)

    def now():
        return np.array([c() for c in clocks])

    t0 = now()
    prepared = prepare(lm, case.edit)
    t_prepare = now() - t0
    reference = greedy_answer(lm, repair(lm, prepared, "Re-prefill").cache, case.edit.query_ids,
                              max_new_tokens=max_new_tokens).token_ids or (0,)
    t_reference = now() - t0 - t_prepare
    rows = []

    def score(cache):
        greedy_answer(lm, cache, case.edit.query_ids, max_new_tokens=max_new_tokens)
        continuation_nll(lm, cache, case.edit, list(reference)) if cache_rows(cache) <= case.num_tokens else None

    from sur_lab.cache_ops import cache_length as cache_rows

    for method in ("Dirty", "Shift", "Replay", "Re-prefill"):
        t = now()
        score(repair(lm, prepared, method).cache)
        rows.append((method, now() - t))
    t = now()
    before = prefill(lm, pre_edit_ids(case.edit, case.inserted_len))[0] if case.inserted_len else prepared.dirty_cache
    note = erratum_note_ids(lm.tokenizer, erratum_note(case.edit, inserted_len=case.inserted_len))
    greedy_answer(lm, erratum(lm, before, case.edit, note, inserted_len=case.inserted_len), case.edit.query_ids,
                  max_new_tokens=max_new_tokens)
    rows.append(("Erratum", now() - t))
    missing = [a for a in STUDY_ALLOCATORS if a not in ALLOCATORS]
    for method in [a for a in STUDY_ALLOCATORS if a in ALLOCATORS]:
        for b in budgets:
            t = now()
            score(repair(lm, prepared, method, b).cache)
            rows.append((f"{method} {b:g}%", now() - t))
    total = t_prepare + t_reference + sum(r[1] for r in rows)
    per_alloc = np.array([r[1] for r in rows[5:]])
    est = total + len(missing) * len(budgets) * (np.median(per_alloc, axis=0) if len(per_alloc) else 0.0)
    print(f"\none case: N={case.num_tokens} tokens, S={case.edit.suffix_len}, {torch.get_num_threads()} threads; "
          f"wall / CPU seconds")
    print(f"  {'prepare (Dirty prefill + Shift)':34s} {t_prepare[0]:6.2f} {t_prepare[1]:6.2f}")
    print(f"  {'Re-prefill reference answer':34s} {t_reference[0]:6.2f} {t_reference[1]:6.2f}")
    for name, sec in rows:
        print(f"  {name:34s} {sec[0]:6.2f} {sec[1]:6.2f}")
    print(f"measured {total[0]:.1f} s wall, {total[1]:.1f} s CPU for {len(rows)} methods; with {len(missing)} "
          f"unregistered allocators ({', '.join(missing)}) at the median allocator time: {est[0]:.1f} s wall, "
          f"{est[1]:.1f} s CPU per case")


def stale_rates_of_the_sweep(lm, args, n: int) -> None:
    """Issue 40's measurement: the study sweep with the references only, then the stale rates and the old-value pull
    per family."""
    import pandas as pd

    from sur_lab.studies import stale_facts

    t0 = time.perf_counter()
    records, where, _ = stale_facts.STUDY.sweep(
        lm, preset="default", seed=args.seed, out=args.out, threads=args.threads, num_cases=n,
        context_lens=[args.context_len], families=list(args.families), allocators=[], budgets=[5],
        references=["Dirty", "Shift", "Re-prefill", "Erratum"], max_new_tokens=args.max_new_tokens, progress=False)
    print(f"{records.case_id.nunique()} cases, {len(records)} records in {where} "
          f"({time.perf_counter() - t0:.0f} s wall)")
    rates = stale_facts.stale_rates(records)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(rates.round(3).to_string(index=False))
        print("\n".join(stale_facts.stale_rate_lines(rates)))
        print(stale_facts.old_margin_differences(records, n_boot=2000).round(2).to_string(index=False))
        counts = pd.crosstab([records["family"], stale_facts._arm(records).rename("arm")], records["answer_class"])
        print(counts.to_string())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="embedded model name (default: SmolLM2)")
    ap.add_argument("--cases", type=int, default=4, help="cases per family")
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", action="store_true", help="also time one case with the issue's method list")
    ap.add_argument("--budgets", type=float, nargs="+", default=[2.0, 5.0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rates", action="store_true", help="the study sweep's stale rates per family (references only)")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=ALL_FAMILIES)
    ap.add_argument("--out", default=None, help="sweep folder for --rates (default: the study's folder)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    n = args.cases * len(args.families)
    if args.rates:
        stale_rates_of_the_sweep(lm, args, n)
    elif n:
        cases = build_stale_cases(lm.tokenizer, context_lens=[args.context_len], num_cases=n, seed=args.seed,
                                  families=args.families)
        probe(lm, cases, args.max_new_tokens)
    if args.time:
        case = build_stale_cases(lm.tokenizer, context_lens=[args.context_len], num_cases=1, seed=args.seed)[0]
        time_one_case(lm, case, args.budgets, args.max_new_tokens)


if __name__ == "__main__":
    main()
