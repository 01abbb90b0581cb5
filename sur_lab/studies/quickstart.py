"""The quickstart case: a real multi-hop QA example with one of its own distractor passages inserted between the
supporting passages, then deleted (the foundation issue's end-to-end check).

As a script it measures, over several examples, how often Shift and SUR give the same answer as Re-prefill::

    python -m sur_lab.studies.quickstart --examples 10 --budget 5
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd
from tqdm.auto import tqdm

from sur_lab.analysis.scoring import extract_answer, score_example
from sur_lab.data.qa import QAExample, load_qa
from sur_lab.edits import EditedContext, chat_edit, format_passages
from sur_lab.models import load_model
from sur_lab.sweeps import Case, records_frame, run_case


def quickstart_edit(tokenizer, example: QAExample, distractor_index: int = 0) -> EditedContext:
    """Edit that deletes ``example.distractors[distractor_index]`` inserted after the first supporting passage.

    The clean document is the supporting passages in dataset order; the inserted distractor sits between the first
    and the second (after the only one when there is one). Deleting it restores the clean document exactly.

    Raises:
        ValueError: naming ``distractor_index`` when the example has no such distractor, or ``example`` when it has no
            supporting passage.
    """
    if not example.supporting:
        raise ValueError(f"example {example.id!r} has no supporting passage")
    if not 0 <= distractor_index < len(example.distractors):
        raise ValueError(
            f"distractor_index={distractor_index} out of range; example {example.id!r} has "
            f"{len(example.distractors)} distractors"
        )
    passages = [example.supporting[0], example.distractors[distractor_index], *example.supporting[1:]]
    documents, spans = format_passages(passages)
    return chat_edit(tokenizer, documents, example.question, spans[1])


def quickstart_scorer(example: QAExample):
    """A ``scorer(case, answer_text) -> bool`` for :func:`sur_lab.sweeps.run_case`: the example's dataset rule on the
    extracted answer (:func:`sur_lab.analysis.scoring.score_example`)."""
    def scorer(case, text: str, example=example) -> bool:
        return score_example(extract_answer(text), example)

    return scorer


def agreement_study(lm, examples, budget_pct: float = 5.0, max_new_tokens: int = 32, progress: bool = True):
    """Per example: answers of Re-prefill, Shift and SUR at ``budget_pct``, agreement and gold EM.

    Each example is one :class:`sur_lab.sweeps.Case` run by :func:`sur_lab.sweeps.run_case` (answers timed per
    request).

    Returns:
        pandas DataFrame, one row per (example, method).
    """
    frames = []
    for ex in tqdm(examples, desc="examples", disable=not progress):
        case = Case(ex.id, quickstart_edit(lm.tokenizer, ex), tuple(ex.answers))
        recs = run_case(lm, case, ("Shift", "Re-prefill", "SUR"), (budget_pct,), max_new_tokens=max_new_tokens,
                        scorer=quickstart_scorer(ex), timed=True)
        df = records_frame(recs)
        frames.append(df.assign(example_id=ex.id, gold=ex.answers[0])[[
            "example_id", "gold", "method", "budget_pct", "allowance", "suffix_len", "num_intervals", "prediction",
            "em", "agree_reprefill", "tv_reprefill", "latency_ms"]])
    return pd.concat(frames, ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--data", default="hotpotqa", help="dataset key or file (default: HotpotQA dev sample)")
    parser.add_argument("--examples", type=int, default=10, help="first N examples with a distractor")
    parser.add_argument("--budget", type=float, default=5.0, help="SUR budget, %% of the suffix")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    lm = load_model(args.model)
    examples = [ex for ex in load_qa(args.data) if ex.distractors and ex.supporting][: args.examples]
    df = agreement_study(lm, examples, args.budget, args.max_new_tokens)
    summary = df.groupby("method")[["agree_reprefill", "em", "tv_reprefill"]].mean()
    print(df[["example_id", "method", "prediction", "gold", "em", "agree_reprefill"]].to_string(index=False))
    print()
    print(summary.to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
