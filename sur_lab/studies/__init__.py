"""Studies: one module (or subpackage) per notebook's experiment, built on the core API and the sweep pipeline.

``quickstart`` (00), ``theory`` (01: the bound and the cost model), ``niah`` (02: Erasing-NIAH, allocation geometry),
``natural_qa`` (03: natural multi-hop QA, quality vs latency), ``bench`` (04: packed refresh benchmark), ``validation``
(05: kernel and executor numerics; with ``execution_paths``, appendix 11), ``noprefix`` (06: non-prefix reuse,
SAFE-KV), ``evidence_location`` (08: the preregistered evidence-location experiment, appendix 10), ``stale_facts``
(09: edits that supersede a value, issue 26), ``agent_traces`` (10: whole agent prompts synced against prefix
reuse) and ``staleness`` (where staleness lives, used by 01). The QA loaders and text helpers they share live in the
data layer (:mod:`sur_lab.data.qa`, :mod:`sur_lab.data.text`). Nothing below this package imports it, and no study
imports another: shared study infrastructure is this package's ``__init__`` and :mod:`sur_lab.studies.presets` only
(``tests/test_layout.py``).

The sweepable studies are registered in :data:`STUDIES` (``sur-lab sweep NAME`` looks them up there; a new study adds
one line). Each exposes the same API, which its notebook and the command both call:

- ``NAME``, ``NOTEBOOK`` (its notebook's stem) and ``FOLDER`` (its sweep folders' prefix);
- ``PRESETS`` (sizes by preset: ``smoke``, ``default``, ``paper``) and ``FIXED`` (the other parameters' defaults,
  the literals of its notebook's ``parameters`` cell); ``params(preset, **overrides)`` resolves them;
- ``cases(tokenizer, *, preset, seed, **overrides)``: the study's :class:`sur_lab.sweeps.Case` objects, and
  ``methods(params)``: its sweep's methods (names or :class:`sur_lab.sweeps.Method` objects);
- ``folder(lm, params, *, seed, eval_batch, executor)``: its sweep folder, named by the parameters and the model's
  fingerprint, so a notebook and the command with the same parameters resume each other's records;
- ``sweep(lm, *, preset, out, seed, workers, threads, address, executor, eval_batch, progress, **overrides)``:
  runs or resumes the sweep, returns ``(records, folder)``;
- its report functions (tables and figures), in the module's last section;
- with a declared primary comparison (:data:`POWER_STUDIES`): ``PRIMARY_POWER`` (its stated discordance rate or SD),
  ``mde(params)`` (the minimal detectable effect at 80 % power, two-sided 5 %) and ``power_line(params)`` (the same
  in words, printed in its notebook's "This run" cell; :func:`power_table` lists them).
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: Sweepable studies by name (``sur-lab sweep NAME``) -> the module implementing the study API.
STUDIES = {
    "niah": "sur_lab.studies.niah",
    "natural-qa": "sur_lab.studies.natural_qa",
    "noprefix": "sur_lab.studies.noprefix",
    "evidence-location": "sur_lab.studies.evidence_location",
    "stale-facts": "sur_lab.studies.stale_facts",
    "agent-traces": "sur_lab.studies.agent_traces",
}


#: Studies whose primary comparison carries a power statement (issue 40): each exposes ``PRIMARY_POWER`` (the stated
#: discordance rate or SD, :class:`sur_lab.analysis.decisions.PowerBasis`), ``mde(params) -> (effect, unit)`` and
#: ``power_line(params)``, printed in its notebook's "This run" cell. Notebook 07 (``agent_session``, no presets)
#: prints its own at its parameters.
POWER_STUDIES = ("niah", "natural-qa", "noprefix", "evidence-location", "stale-facts", "agent-traces")


def get_study(name: str) -> ModuleType:
    """The study module registered as ``name`` (imported on first use).

    Raises:
        ValueError: naming ``name`` and listing the registered studies.
    """
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; registered studies: {', '.join(STUDIES)}")
    return importlib.import_module(STUDIES[name])


def power_table(presets=("smoke", "default", "paper")):
    """The minimal detectable effect of every :data:`POWER_STUDIES` study's primary comparison at each preset (80 %
    power, two-sided 5 %; its ``mde(params(preset))``): one row per study with its notebook, one column per preset
    (the effect in its unit, or "none" when the size cannot reach 80 %) and the stated basis. ``docs/decisions.md``
    holds it as :func:`power_markdown` renders it (``tests/test_power.py`` checks that the page is current).

    Raises:
        ValueError: naming a preset a study does not define.
    """
    import pandas as pd

    from sur_lab.analysis.decisions import effect_text

    rows = []
    for name in POWER_STUDIES:
        study = get_study(name)
        row = {"notebook": study.NOTEBOOK, "study": name}
        for preset in presets:
            row[preset] = effect_text(*study.mde(study.params(preset)))
        basis = study.PRIMARY_POWER
        row["basis"] = (f"{'discordance' if basis.unit == 'pp' else 'SD'} {basis.value:.3g}: {basis.source}")
        rows.append(row)
    return pd.DataFrame(rows, columns=["notebook", "study", *presets, "basis"])


def power_markdown() -> str:
    """:func:`power_table` as the Markdown table of ``docs/decisions.md`` (regenerate it with ``python -c "from
    sur_lab.studies import power_markdown; print(power_markdown())"``)."""
    table = power_table()
    cols = list(table.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f"`{v}`" if c in ("notebook", "study") else str(v) for c, v in zip(cols, r)) + " |"
              for r in table.itertuples(index=False)]
    return "\n".join(lines)


__all__ = ["POWER_STUDIES", "STUDIES", "get_study", "power_markdown", "power_table"]
