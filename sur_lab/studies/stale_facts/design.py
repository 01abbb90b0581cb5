"""The stale-facts study's design, fixed before any run: its task families (the study's roster, the derived ones of
issue 40, the exploratory ones, the controls), the answer classes, the reference operators and allocators it compares,
its preset sizes, and its declared comparisons (the primary, :data:`EM_FAMILY`, :data:`STALE_FAMILY`, the Erratum
placement control's :data:`PLACEMENT_FAMILY`; issue 36, :mod:`sur_lab.analysis.decisions`).

The case construction (:mod:`~sur_lab.studies.stale_facts.construction`), the study
(:mod:`~sur_lab.studies.stale_facts.study`) and its report (:mod:`~sur_lab.studies.stale_facts.report`) all read these
names, so they sit below all three: the study's ``report`` calls the report's functions, which decide these families,
and a module above both would make a cycle.
"""

from __future__ import annotations

from sur_lab.analysis.decisions import Family, PowerBasis

__all__ = ["FAMILIES", "DERIVED_FAMILIES", "REBOUND_FAMILIES", "ALL_FAMILIES", "CONTROL_FAMILIES", "ANSWER_CLASSES",
    "STUDY_REFERENCES", "STUDY_ALLOCATORS", "PRESETS", "COMPARED", "PRIMARY_BUDGET", "PRIMARY", "PRIMARY_POWER",
    "EM_FAMILY", "STALE_FAMILY", "LATE", "PLACEMENT_METHODS", "PLACEMENT_FAMILY", "STALE_REACH", "PULL_ARMS",
    "MARGIN_ARMS"]


#: Task families: the three controls of issue 26, then the two of issue 40 whose answer-bearing text lies downstream
#: of the edit and depends on the edited value (:data:`DERIVED_FAMILIES`).
FAMILIES = ("value_update", "superseded_tool_output", "multi_key", "derived_record", "agent_note")
#: Families whose answer-bearing text is a later block that refers to the edited value without restating it (a
#: derived record, an agent note written after the tool output): their states were computed while the old value was
#: visible, so they are the states that can carry a stale answer (issue 40).
DERIVED_FAMILIES = ("derived_record", "agent_note")
#: Exploratory families, built on request (``families=``) but not in the study's roster (:data:`FAMILIES`):
#: ``rebound_reference`` re-points a derived record from one service to another, and both services' value records
#: follow it, so the answer-bearing states were computed while the old reference was visible and the stale value is
#: in the suffix. It was tried for issue 40's reachability check (``scripts/stale_facts_probe.py --families
#: rebound_reference``); on the study model the answer did not follow the reference under any arm, Dirty included, so
#: it cannot tell a stale state from a misread one and is not a study family.
REBOUND_FAMILIES = ("rebound_reference",)
#: Every family :func:`build_stale_case` builds.
ALL_FAMILIES = FAMILIES + REBOUND_FAMILIES
#: The three families of issue 26, kept as controls: their answer-bearing text is the inserted block or an untouched
#: block, so every arm but Dirty sees the answer in clean states.
CONTROL_FAMILIES = ("value_update", "superseded_tool_output", "multi_key")
#: Answer classes of :func:`classify_answer`.
ANSWER_CLASSES = ("correct", "stale", "mixed", "distractor", "wrong")
#: Reference operators of the study (issue 26): the four of the paper and Erratum.
STUDY_REFERENCES = ("Dirty", "Shift", "Replay", "Re-prefill", "Erratum")
#: Allocators of the study (issue 26). "Edit-local window" and "Edit-local + SUR" are registered by another module.
STUDY_ALLOCATORS = (
    "SUR", "SUR-IDF", "Max-relevance contiguous", "Edit-local window", "Edit-local + SUR", "Dense tokens",
    "Random semantic units",
)


#: Study sizes by preset (:func:`sur_lab.studies.presets.resolve_preset`). ``smoke`` exercises every compared arm and
#: every family on SmolLM2 (plumbing only). ``default`` runs the Qwen study model on 48 cases (9 or 10 per family of
#: the five; the sizes of issue 26, not yet resized for issue 40's families) at 2 % and 5 % with the issue's method
#: list; its context length is sized from the CPU time of one case
#: (``scripts/stale_facts_probe.py --time`` measured about 54 s of CPU per 524-token case; 384 tokens keeps 48 cases
#: within 40 min by an estimate that scales that time with the context length, with a fifth of it held fixed for
#: decoding and overheads). ``paper`` is 432 cases (two
#: replicates of the 3 x 2 x 3 x 3 x 4 factorial) over 1K-8K at 2, 5 and 10 %, on Ray or a GPU.
PRESETS = {
    "smoke": {"context_lens": [256], "num_cases": 5, "edit_depths": [0.3], "distances": [0.3], "num_keys": 3,
              "budgets": [5], "max_new_tokens": 6,
              "allocators": ["SUR", "SUR-IDF", "Edit-local window", "Edit-local + SUR"]},
    "default": {"context_lens": [384], "num_cases": 48, "edit_depths": [0.2, 0.5], "distances": [0.1, 0.4],
                "num_keys": 4, "budgets": [2, 5], "max_new_tokens": 8, "allocators": list(STUDY_ALLOCATORS)},
    "paper": {"context_lens": [1024, 2048, 4096, 8192], "num_cases": 432, "edit_depths": [0.1, 0.3, 0.5],
              "distances": [0.05, 0.2, 0.4], "num_keys": 4, "budgets": [2, 5, 10], "max_new_tokens": 8,
              "allocators": list(STUDY_ALLOCATORS)},
}


#: The arms of the paired comparisons (issue 26): SUR, its variant and the 2026 baselines.
COMPARED = ("SUR", "SUR-IDF", "Edit-local window", "Edit-local + SUR", "Erratum")
#: The budget (%) of the primary comparison.
PRIMARY_BUDGET = 5.0
#: The declared comparisons of notebook 09 (issue 36; :mod:`sur_lab.analysis.decisions`), fixed before any run: one
#: primary comparison and two small families (the all-pairs table they replace held 38 comparisons per endpoint).
#: Cases are the paired units (independent constructions).
PRIMARY = Family("primary", "binary", f"SUR at {PRIMARY_BUDGET:g} % minus Shift on EM", primary=True)
#: The power statement's basis (issue 40; :data:`POWER`): a planning value, not a measurement. No paper reports this
#: comparison; SUR and Shift are taken to disagree on half the cases (two arms each right about half the time,
#: independently), the rate that a measured default run replaces.
PRIMARY_POWER = PowerBasis(0.5, "a planning value (no published rate): SUR and Shift disagree on half the cases")
EM_FAMILY = Family("EM against SUR", "binary",
                   "SUR-IDF, the edit-local window and edit-local + SUR minus SUR at the same budget, and Erratum "
                   "minus SUR at each budget, on EM")
STALE_FAMILY = Family("stale-answer rate against Shift", "binary",
                      "each compared arm (SUR, SUR-IDF, the edit-local window, edit-local + SUR at each budget; "
                      "Erratum) minus Shift on the stale-answer rate, over the cases that ask the edited key (lower is "
                      "better)",
                      higher_is_better=False)
#: The Erratum placement control (issue 40): on each replacement case, Shift and Re-prefill also run on
#: :attr:`StaleCase.control_edit` (the inserted block right before the question, where Erratum's note sits); their
#: records carry these method labels and the case's own ``case_id``, so they pair with Erratum case by case.
LATE = " (late)"
PLACEMENT_METHODS = ("Shift", "Re-prefill")
PLACEMENT_FAMILY = Family("Erratum at equal recency", "binary",
                          "Re-prefill and Shift with the inserted block right before the question (the placement "
                          "control) minus Erratum, on EM, over the replacement cases")
#: The design requirement of issue 40 checked per family (:func:`stale_rates`): Shift answers the old value in at
#: least this fraction of the family's stale-eligible cases, by the exact (Clopper-Pearson) lower bound.
STALE_REACH = 0.05
#: Arms whose old-value pull (``old_margin``) is compared with Re-prefill's per family (:func:`old_margin_differences`;
#: descriptive intervals).
PULL_ARMS = ("Shift", "Dirty", "Erratum", f"SUR {PRIMARY_BUDGET:g}%", "Shift" + LATE)
#: The gold-margin differences by answer location (:func:`margin_differences`) are descriptive: intervals only, no
#: verdict (they are not a declared family).
MARGIN_ARMS = ("Edit-local window", "Edit-local + SUR")
