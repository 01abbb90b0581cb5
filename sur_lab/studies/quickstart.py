"""The quickstart case: a real multi-hop QA example with one of its own distractor passages inserted between the
supporting passages, then deleted (the foundation issue's end-to-end check).

As a script it measures, over several examples, how often Shift and SUR give the same answer as Re-prefill::

    python -m sur_lab.studies.quickstart --examples 10 --budget 5
"""

from __future__ import annotations

import argparse
import sys

from sur_lab.edits import EditedContext, chat_edit, format_passages
from sur_lab.studies.datasets import QAExample, load_qa


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


def agreement_study(lm, examples, budget_pct: float = 5.0, max_new_tokens: int = 32, progress: bool = True):
    """Per example: answers of Re-prefill, Shift and SUR at ``budget_pct``, agreement and gold EM.

    Returns:
        pandas DataFrame, one row per (example, method).
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from sur_lab.analysis.evaluate import evaluate_case
    from sur_lab.analysis.scoring import score_example

    rows = []
    for ex in tqdm(examples, desc="examples", disable=not progress):
        edit = quickstart_edit(lm.tokenizer, ex)
        recs = evaluate_case(
            lm, edit, ("Shift", "Re-prefill", "SUR"), (budget_pct,), max_new_tokens=max_new_tokens,
            scorer=lambda pred, ex=ex: score_example(pred, ex),
        )
        for r in recs:
            rows.append({"example_id": ex.id, "gold": ex.answers[0], **{k: r[k] for k in (
                "method", "budget_pct", "allowance", "suffix_len", "num_intervals", "prediction", "em",
                "agree_reprefill", "tv_reprefill", "latency_ms")}})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--data", default="hotpotqa", help="dataset key or file (default: HotpotQA dev sample)")
    parser.add_argument("--examples", type=int, default=10, help="first N examples with a distractor")
    parser.add_argument("--budget", type=float, default=5.0, help="SUR budget, %% of the suffix")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    from sur_lab.models import load_model

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
