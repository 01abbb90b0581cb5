"""Studies: one module (or subpackage) per notebook's experiment, built on the core API and the sweep pipeline.

``quickstart`` (00), ``theory`` (01: the bound and the cost model), ``niah`` (02: Erasing-NIAH, allocation geometry),
``natural_qa`` (03: natural multi-hop QA, quality vs latency), ``bench`` (04: packed refresh benchmark), ``validation``
(05: kernel and executor numerics; with ``execution_paths``, appendix 11), ``noprefix`` (06: non-prefix reuse,
SAFE-KV), ``evidence_location`` (08: the preregistered evidence-location experiment, appendix 10), ``stale_facts``
(09: edits that supersede a value, issue 26), ``agent_traces`` (10: whole agent prompts synced against prefix
reuse) and ``staleness`` (where staleness lives, used by 01). The QA loaders and text helpers they share live in the
data layer (:mod:`sur_lab.data.qa`, :mod:`sur_lab.data.text`). Nothing below this package imports it, and no study
imports another: shared study infrastructure is this package's ``__init__``, :mod:`sur_lab.studies.base` and
:mod:`sur_lab.studies.presets` only (``tests/test_layout.py``).

The sweepable studies are :class:`sur_lab.studies.base.Study` instances registered in :data:`STUDIES` (``sur-lab
sweep NAME`` looks them up there; a new study adds one line). A study is a page of declarations (name, notebook,
presets, fixed parameters, folder keys, scorer, primary comparison) plus its ``cases``, ``methods`` and ``report``; the
base writes ``params``, ``folder``, ``sweep`` (records, folder and cases), ``check``, ``mde``, ``power_line`` and
``conclusion`` once, and the notebooks and the command call those. Each study module holds its instance as ``STUDY``
(the non-prefix study also ``POSITIONS``, its evidence position sweep). :data:`POWER_STUDIES` are the studies whose
primary comparison carries a power statement (:func:`power_table` lists them).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

import pandas as pd

from sur_lab.analysis.decisions import effect_text
from sur_lab.studies.base import Study


class StudyRegistry(Mapping):
    """Sweepable studies by name: each entry is a module path whose ``STUDY`` is imported on first access, and every
    value handed out is a :class:`sur_lab.studies.base.Study` instance.

    Raises (on access):
        KeyError: naming an unknown study and listing the registered ones.
        TypeError: naming the entry when its module's ``STUDY`` (or a value given to :meth:`register`) is not a
            :class:`~sur_lab.studies.base.Study` instance.
    """

    def __init__(self, modules: Mapping[str, str]) -> None:
        self._modules = dict(modules)
        self._loaded: dict[str, Study] = {}

    def register(self, study: Study) -> None:
        """Add (or replace) ``study`` under its ``name``.

        Raises:
            TypeError: naming ``study`` when it is not a :class:`~sur_lab.studies.base.Study` instance.
        """
        self._loaded[_checked(study, "study")] = study
        self._modules.setdefault(study.name, type(study).__module__)

    def __getitem__(self, name: str) -> Study:
        if name not in self._modules:
            raise KeyError(f"unknown study {name!r}; registered studies: {', '.join(self._modules)}")
        if name not in self._loaded:
            study = getattr(importlib.import_module(self._modules[name]), "STUDY", None)
            if _checked(study, f"{self._modules[name]}.STUDY") != name:
                raise TypeError(f"{self._modules[name]}.STUDY is named {study.name!r}, registered as {name!r}")
            self._loaded[name] = study
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)

    def __contains__(self, name: object) -> bool:
        return name in self._modules


def _checked(study, what: str) -> str:
    """``study.name`` when ``study`` is a :class:`~sur_lab.studies.base.Study` instance.

    Raises:
        TypeError: naming ``what`` and the type it has.
    """
    if not isinstance(study, Study):
        raise TypeError(f"{what} must be a sur_lab.studies.base.Study instance; got {type(study).__name__}")
    return study.name


#: Sweepable studies by name (``sur-lab sweep NAME``) -> their :class:`~sur_lab.studies.base.Study` instance (each
#: module's ``STUDY``, imported on first access).
STUDIES = StudyRegistry({
    "niah": "sur_lab.studies.niah",
    "natural-qa": "sur_lab.studies.natural_qa",
    "noprefix": "sur_lab.studies.noprefix.study",
    "evidence-location": "sur_lab.studies.evidence_location.study",
    "stale-facts": "sur_lab.studies.stale_facts.study",
    "agent-traces": "sur_lab.studies.agent_traces",
})


#: Studies whose primary comparison carries a power statement (issue 40): their ``mde(params)`` and
#: ``power_line(params)`` (:class:`~sur_lab.studies.base.Study`) read the declared ``primary`` and ``primary_power``;
#: the notebook prints the line in its "This run" cell. Notebook 07 (``agent_session``, no presets) prints its own at
#: its parameters.
POWER_STUDIES = ("niah", "natural-qa", "noprefix", "evidence-location", "stale-facts", "agent-traces")


def get_study(name: str) -> Study:
    """The study registered as ``name`` (its module imported on first use).

    Raises:
        ValueError: naming ``name`` and listing the registered studies.
    """
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; registered studies: {', '.join(STUDIES)}")
    return STUDIES[name]


def power_table(presets=("smoke", "default", "paper")):
    """The minimal detectable effect of every :data:`POWER_STUDIES` study's primary comparison at each preset (80 %
    power, two-sided 5 %; its ``mde(params(preset))``): one row per study with its notebook, one column per preset
    (the effect in its unit, or "none" when the size cannot reach 80 %) and the stated basis. ``docs/decisions.md``
    holds it as :func:`power_markdown` renders it (``tests/test_power.py`` checks that the page is current).

    Raises:
        ValueError: naming a preset a study does not define.
    """
    rows = []
    for name in POWER_STUDIES:
        study = get_study(name)
        row = {"notebook": study.notebook, "study": name}
        for preset in presets:
            row[preset] = effect_text(*study.mde(study.params(preset)))
        basis = study.power.basis
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


__all__ = ["POWER_STUDIES", "STUDIES", "StudyRegistry", "get_study", "power_markdown", "power_table"]
