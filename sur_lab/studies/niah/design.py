"""The Erasing-NIAH study's design, fixed before any run: the methods it compares (the paper's fourteen allocators,
the methods beyond the paper, SUR's design factors and the boundary controls), the budgets of its comparisons, the
matched-token holdout seed, and its declared families (issue 36; :mod:`sur_lab.analysis.decisions`).

The study (:mod:`~sur_lab.studies.niah.study`), its report (:mod:`~sur_lab.studies.niah.report`) and the matched-token
protocol (:mod:`~sur_lab.studies.niah.matched`) all read these names, so they sit below all three: the study's
``report`` calls the report's functions, which decide these families, and a module above both would make a cycle.
"""

from __future__ import annotations

from sur_lab.analysis.decisions import Family

__all__ = ["PAPER_ALLOCATORS", "BEYOND_PAPER", "SUR_FACTORS", "JOINT_ARM", "BOUNDARY_CONTROLS", "ABLATION",
    "HOLDOUT_SEED", "PRIMARY_BUDGET", "FAMILY_BUDGETS", "PRIMARY", "RIVALS", "BEYOND", "ABLATION_FAMILY", "MATCHED",
    "MATCHED_BY_LENGTH", "ALL_AGAINST_REFERENCES"]

#: The fourteen allocators in the order of Tables 2–6.
PAPER_ALLOCATORS = (
    "SUR",
    "Dense tokens",
    "Max-relevance contiguous",
    "BM25 (same units)",
    "Random semantic units",
    "ProphetKV-Adapted",
    "InfoFlow-Motivated",
    "Cache-Craft-Adapted",
    "CacheBlend-Adapted",
    "A3-Adapted",
    "LegoLink-Adapted",
    "CacheTune-Adapted",
    "SpecCache-Adapted",
    "Clean-state oracle",
)

#: Methods beyond the paper in the ``paper`` and ``default`` presets (issue 26): SUR's tie-robust variant, the edit-local baselines
#: of "Contiguity, Not Importance" and the Erratum reference operator (listed with the references).
BEYOND_PAPER = ("SUR-IDF", "Edit-local window", "Edit-local + SUR", "Erratum")
#: SUR's design factors (appendix 9.3), one at a time: ``(factor, the paper's setting, the changed setting, method)``.
#: Each method is SUR with exactly one option changed (``docs/allocators.md``); the bonus factor has two changes.
SUR_FACTORS = (
    ("aggregation", "top4", "mean", "SUR[aggregation=mean]"),
    ("partial_unit", "forward", "prefix", "SUR[partial_unit=prefix]"),
    ("allowance_base", "suffix", "prompt", "SUR[allowance_base=prompt]"),
    ("bonus", "paper", "idf", "SUR-IDF"),
    ("bonus", "paper", "off", "SUR[bonus=off]"),
)
#: Appendix 9.3's second arm: mean aggregation, prefix partial unit and whole-prompt allowance changed together.
JOINT_ARM = "SUR[aggregation=mean,partial_unit=prefix,allowance_base=prompt]"
#: The matched controls of text boundaries that appendix 9.3 says are missing (beyond the paper, issue 28): SUR's
#: region allocation over equal token blocks, and k windows around the top tokens (k = SUR's interval count).
BOUNDARY_CONTROLS = ("Fixed blocks", "Multiple local windows")
#: The full one-factor-at-a-time ablation (the ``paper`` preset's ``ablation``).
ABLATION = (*(f[3] for f in SUR_FACTORS), JOINT_ARM, *BOUNDARY_CONTROLS)
#: Seed of the frozen holdout roster of the matched-token study (Table 14 analogue,
#: :func:`~sur_lab.studies.niah.matched.matched_sweep`). No design run used it: every NIAH run before issue 28
#: (notebook 02, the tests, the reported default runs) used seed 0.
HOLDOUT_SEED = 9314

#: The budget (%) of the primary comparison: the ``default`` preset is sized to separate SUR at 5 % from Shift.
PRIMARY_BUDGET = 5.0
#: The budgets (%) of the secondary families :data:`RIVALS` and :data:`BEYOND`: the paper's headline budgets, so that
#: the ``paper`` preset's six budgets do not multiply the families (a run without them uses every budget it ran).
FAMILY_BUDGETS = (2.0, 5.0)
#: The declared families of notebook 02 (issue 36; :mod:`sur_lab.analysis.decisions`), fixed before any run. The
#: lead endpoint is strict EM, or agreement with Re-prefill when Re-prefill's EM is below
#: :data:`sur_lab.studies.presets.EM_LEAD_MIN`; cases are the paired units (independent constructions, no clusters).
PRIMARY = Family("primary", "binary", f"SUR at {PRIMARY_BUDGET:g} % minus Shift on the lead endpoint", primary=True)
RIVALS = Family("SUR against the references and the paper's allocators", "binary",
                "SUR at each family budget minus Shift and Re-prefill (the primary excepted) and minus each other "
                "allocator of Tables 2-6 at the same budget, on the lead endpoint")
BEYOND = Family("beyond the paper", "binary",
                "SUR-IDF, the edit-local window, edit-local + SUR and Erratum minus SUR at each family budget, on the "
                "lead endpoint")
ABLATION_FAMILY = Family("SUR's design factors", "binary",
                         "each one-factor variant and boundary control minus SUR at the same budget, per endpoint")
MATCHED = Family("matched tokens (holdout roster)", "binary",
                 "the region arm (SUR's whole units up to its stopping point) minus each token-level allocator at "
                 "the same per-case count, at each matched budget, every length pooled, per endpoint")
MATCHED_BY_LENGTH = Family("matched tokens by context length (holdout roster)", "binary",
                           "the same comparisons within each context length (1K, 2K, ...), per endpoint")


ALL_AGAINST_REFERENCES = Family("every allocator against Shift and Re-prefill (the figure)", "binary",
                                "each allocator at each budget minus Shift and minus Re-prefill, on one endpoint")
