"""The Erasing-NIAH study (notebook 02 and ``sur-lab sweep niah`` call the same methods): :data:`STUDY`, a
:class:`~sur_lab.studies.base.Study` declaring :data:`PRESETS` (sizes), :data:`FIXED` (the other parameters' defaults),
its cases (:mod:`~sur_lab.studies.niah.cases`) and methods, its families (:mod:`~sur_lab.studies.niah.design`) and
its primary comparison's power (:data:`POWER`); the base's :meth:`~sur_lab.studies.base.Study.sweep` returns the
records, the sweep folder (named the same way for both, so each resumes the other's records) and the cases. The
report is :mod:`~sur_lab.studies.niah.report`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from sur_lab.analysis.decisions import PowerBasis, PowerDesign, discordance_from_marginals
from sur_lab.repair import REFERENCE_OPERATORS
from sur_lab.studies.base import Report, Study
from sur_lab.studies.niah.cases import build_niah_cases, niah_scorer, parse_niah_answer
from sur_lab.studies.niah.design import (
    ABLATION,
    ABLATION_FAMILY,
    ALL_AGAINST_REFERENCES,
    BEYOND,
    BEYOND_PAPER,
    HOLDOUT_SEED,
    MATCHED,
    MATCHED_BY_LENGTH,
    PAPER_ALLOCATORS,
    PRIMARY,
    PRIMARY_BUDGET,
    RIVALS,
)
from sur_lab.studies.niah.report import budget_table, conclusion, decide_families
from sur_lab.studies.presets import lead_endpoint

__all__ = ["PRIMARY_POWER", "MATCHED_DEFAULT_CASES", "PRESETS", "NAME", "NOTEBOOK", "FOLDER", "FIXED", "POWER",
    "NiahStudy", "STUDY"]

#: The power statement's basis (issue 40; :data:`POWER`): the primary comparison's discordance rate, from the paper's
#: Table 2 (Qwen3-8B, 96 cases): SUR at 5 % has 98.96 % EM and Shift 0 %, so every case SUR answers is discordant.
PRIMARY_POWER = PowerBasis(discordance_from_marginals(0.9896, 0.0),
                           "the paper's Table 2 (Qwen3-8B): SUR 5 % 98.96 % EM against Shift's 0 %")


#: Holdout cases of the matched-token sweep at ``default``. Issue 40 asks 120 (at 80 % power, two-sided 5 %, paired
#: binary outcomes, about 120 cases separate the paper's +9.85 pp at the smaller support of Table 14; 600 its +1.84 pp
#: at the larger one), but a matched case costs one to two minutes on 2 cores (Dense tokens' scattered refresh
#: dominates), so 120 cases alone would overrun the suite's 3 hours: ``default`` holds 24 (12 at each of 1K and 2K
#: tokens), which separates only large differences (its printed smallest separable difference says how large), and
#: ``paper`` holds the issue's size and beyond (600, the paper's holdout of 599).
MATCHED_DEFAULT_CASES = 24
#: Study sizes by preset (issue 13; :func:`sur_lab.studies.presets.resolve_preset`). ``default`` is sized so that a
#: paired bootstrap can separate SUR-5 % from Shift on the Qwen study model if the paper's effect exists there (48
#: cases, 24 at each of 1K and 2K tokens: issue 23 spent the time batched answering saves on more cases and a second
#: length), and compares SUR with its tie-robust variant SUR-IDF beside the matched controls, the edit-local
#: baselines and Erratum (:data:`BEYOND_PAPER`, issue 26's paired tables come from this run).
#: ``ablation`` (SUR's variants and the boundary controls, run with the allocators on the same cases) and
#: ``matched_allocators`` (token-level allocators given the region arm's per-case count on the holdout roster; ``[]``:
#: no matched-token sweep; ``matched_cases``: the holdout roster's size, cases alternating over ``context_lens``) are
#: the design-evidence lists of issue 28: the full ones in ``paper``, reduced ones in ``default`` (the bonus factor is
#: SUR-IDF, already among its allocators). The matched-token sweep's sizes are issue 40's: :data:`MATCHED_DEFAULT_CASES`
#: holdout cases at ``default`` against Dense tokens alone (the paper's Table 14 compares SUR V1 with token selection
#: by the query score, which is SUR's own token score: Dense tokens), 600 at ``paper`` (the paper's holdout: 599).
PRESETS = {
    "smoke": {"context_lens": [256], "num_cases": 1, "budgets": [2, 5], "max_new_tokens": 4,
              "allocators": ["SUR", "Dense tokens", "Max-relevance contiguous", "BM25 (same units)",
                             "Random semantic units", "CacheBlend-Adapted", "Edit-local window", "Erratum"],
              "ablation": ["SUR[aggregation=mean]", "Fixed blocks", "Multiple local windows"],
              "matched_allocators": ["Dense tokens"], "matched_cases": 1},
    "default": {"context_lens": [1024, 2048], "num_cases": 48, "budgets": [2, 5], "max_new_tokens": 16,
                "allocators": ["SUR", "SUR-IDF", "Dense tokens", "Max-relevance contiguous", "BM25 (same units)",
                               "Random semantic units", "Edit-local window", "Edit-local + SUR", "Erratum"],
                "ablation": ["SUR[aggregation=mean]", "SUR[partial_unit=prefix]", "Fixed blocks",
                             "Multiple local windows"],
                "matched_allocators": ["Dense tokens"], "matched_cases": MATCHED_DEFAULT_CASES},
    "paper": {"context_lens": [1024, 2048, 4096, 8192, 16384, 32768], "num_cases": 96,
              "budgets": [2, 5, 10, 20, 40, 80], "max_new_tokens": 32, "allocators": [*PAPER_ALLOCATORS, *BEYOND_PAPER],
              "ablation": list(ABLATION),
              "matched_allocators": ["Dense tokens", "ProphetKV-Adapted", "InfoFlow-Motivated", "Cache-Craft-Adapted",
                                     "CacheBlend-Adapted", "A3-Adapted", "Clean-state oracle"],
              "matched_cases": 600},
}
#: The study's name in the registry (``sur-lab sweep niah``), its notebook, and its sweep folders' prefix.
NAME = "niah"
NOTEBOOK = "02_allocation_geometry"
FOLDER = "02_niah"
#: Parameters that are not preset sizes, at the notebook's defaults (the literals of its ``parameters`` cell).
FIXED = {"depths": [0.25, 0.5, 0.75], "references": ["Dirty", "Shift", "Replay", "Re-prefill"],
         "matched_region": "SUR", "matched_count": "whole_units", "matched_budgets": [2, 5],
         "holdout_seed": HOLDOUT_SEED}


#: The primary comparison's power design (issue 40): the study's ``mde`` and ``power_line`` (the
#: :class:`~sur_lab.studies.base.Study` base's) at its parameters.
POWER = PowerDesign(f"SUR {PRIMARY_BUDGET:g}% vs Shift on the lead endpoint", PRIMARY, PRIMARY_POWER,
                    lambda p: p["num_cases"])


class NiahStudy(Study):
    """Erasing-NIAH (notebook 02): every case x (references + allocators x budgets), strictly scored
    (:func:`niah_scorer`). NIAH has no latency endpoint: its answers are never timed."""

    name, notebook, folder_prefix = NAME, NOTEBOOK, FOLDER
    presets, fixed = PRESETS, FIXED
    folder_keys = {"ctx": "context_lens", "n": "num_cases", "b": "budgets", "tok": "max_new_tokens", "seed": "seed",
                   "eb": "eval_batch"}
    scorer, parser = staticmethod(niah_scorer), staticmethod(parse_niah_answer)
    power = POWER
    families = (PRIMARY, RIVALS, BEYOND, ABLATION_FAMILY, MATCHED, MATCHED_BY_LENGTH, ALL_AGAINST_REFERENCES)

    def methods(self, p: Mapping[str, Any]) -> list[str]:
        """The sweep's methods for parameters ``p``: the references, then the allocators in Table 2-6 order (others
        after, in the given order), then the ``ablation`` methods not already listed (SUR's variants and the boundary
        controls, on the same cases and budgets). A reference operator named among the allocators (the ``paper``
        preset's ``"Erratum"``) is listed after the references."""
        refs = list(p["references"])
        refs += [a for a in p["allocators"] if a in REFERENCE_OPERATORS and a not in refs]
        allocators = [a for a in p["allocators"] if a not in REFERENCE_OPERATORS]
        ordered = [a for a in PAPER_ALLOCATORS if a in allocators] + [a for a in allocators
                                                                      if a not in PAPER_ALLOCATORS]
        ordered += [a for a in dict.fromkeys(p.get("ablation", ())) if a not in ordered]
        return refs + ordered

    def cases(self, tokenizer, p: Mapping[str, Any], seed: int = 0, *,
              corpus: Sequence[Any] | None = None) -> list:
        """The study's cases for parameters ``p``: :func:`build_niah_cases` as :class:`sur_lab.sweeps.Case` objects
        (``corpus``: filler paragraphs, default :func:`sur_lab.data.qa.load_corpus`).

        Raises:
            ValueError: as :func:`build_niah_cases`.
        """
        built = build_niah_cases(tokenizer, context_lens=p["context_lens"], depths=p["depths"],
                                 num_cases=p["num_cases"], seed=seed, corpus=corpus)
        return [c.sweep_case() for c in built]

    def sweep_cases(self, cases: Any, p: Mapping[str, Any]) -> list:
        """:meth:`cases` are sweep cases already."""
        return list(cases)

    def report(self, records: pd.DataFrame, p: Mapping[str, Any], *, decide: bool = True) -> Report:
        """The lead endpoint's budget table (:func:`budget_table`), the declared families (:func:`decide_families`)
        and their conclusion lines (:func:`conclusion`); the lead endpoint is EM when Re-prefill's EM allows
        (:func:`sur_lab.studies.presets.lead_endpoint`). ``decide``: ``False`` at a plumbing-check size."""
        metric = lead_endpoint(float(records.loc[records["method"] == "Re-prefill", "em"].mean()))
        allocators = [m for m in self.methods(p) if m in set(records["method"]) and m not in p["references"]]
        decided = decide_families(records, metric=metric, decide=decide)
        return Report(tables={"budget": budget_table(records, metric), "decided": decided},
                      conclusion=conclusion(records, decided, metric=metric, allocators=allocators, decide=decide))


STUDY = NiahStudy()
