"""The :class:`Study` base: a sweepable study is a page of declarations plus its cases, methods and report.

A study declares what it is (``name``, ``notebook``, ``folder_prefix``), its parameters (``presets``: sizes by preset,
``fixed``: the other parameters' defaults, the literals of its notebook's ``parameters`` cell), how its folder is named
(``folder_keys``), how its answers are scored (``scorer``, ``parser``), its declared families and its primary
comparison's power design (``power``, a :class:`sur_lab.analysis.decisions.PowerDesign`). It implements three things:
:meth:`Study.cases` (its cases from a tokenizer, its parameters and a seed), :meth:`Study.methods` (its sweep's
methods) and :meth:`Study.report` (its tables, figures and conclusion lines, a :class:`Report`).

Written once here, for every study: :meth:`Study.params` (:func:`sur_lab.studies.presets.study_params`),
:meth:`Study.folder` (:func:`sur_lab.sweeps.sweep_folder` of the declared keys), :meth:`Study.sweep` (parameters,
cases, folder, :func:`sur_lab.sweeps.run_sweep`; returns a :class:`SweepResult`: the records, the folder and the cases,
so a notebook never builds its cases twice), :meth:`Study.check` (the parameters refused before any model call),
:meth:`Study.mde` / :meth:`Study.power_line` (the primary comparison's power statement, issue 40) and
:meth:`Study.conclusion`. A study with more to do overrides a hook (:meth:`Study.sweep_cases`, :meth:`Study.timed`,
:meth:`Study.scorer_for`, :meth:`Study.options`, :meth:`Study.finish`, or :meth:`Study.run` for a study whose records
are not :func:`sur_lab.sweeps.run_sweep`'s).

Source: issue 39 ("Studies as declarations on a data floor"), item 2.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

#: The run arguments a ``folder_keys`` entry may name besides the study's parameters.
RUN_ARGUMENTS = ("seed", "eval_batch", "executor")


@dataclass
class Report:
    """What a study's report shows: its tables (name -> DataFrame), its figures (name -> matplotlib Figure) and the
    conclusion lines its notebook prints last (words from :mod:`sur_lab.analysis.decisions`, no typed numbers)."""

    tables: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    conclusion: list[str] = field(default_factory=list)


class SweepResult(NamedTuple):
    """What :meth:`Study.sweep` returns: the records (a DataFrame, :func:`sur_lab.sweeps.records_frame` columns plus
    the case meta, or the study's own table), the folder holding them, and the study's cases (:meth:`Study.cases`)."""

    records: Any
    folder: Path
    cases: Any


class Study(ABC):
    """A sweepable study (issue 39). Subclasses set the class attributes below and implement :meth:`cases`,
    :meth:`methods` and :meth:`report`; :data:`sur_lab.studies.STUDIES` holds one instance of each.

    Attributes:
        name: the registry name (``sur-lab sweep NAME``). notebook: its notebook's stem. folder_prefix: its sweep
            folders' prefix.
        presets: sizes by preset (``smoke``, ``default``, ``paper``). fixed: the other parameters at their defaults.
        folder_keys: the folder name's entries in order, key -> a parameter name, one of :data:`RUN_ARGUMENTS`, or a
            callable of the merged parameters and run arguments. ``ex`` (the executor) is appended when it is not
            ``"sequential"`` unless listed.
        scorer: ``(case, text) -> bool`` (EM), or ``None`` for the sweep's default; parser: the answer parser.
        power: the primary comparison's :class:`~sur_lab.analysis.decisions.PowerDesign` (its words, its
            :class:`~sur_lab.analysis.decisions.Family`, its stated :class:`~sur_lab.analysis.decisions.PowerBasis` and
            its size at the study's parameters); :attr:`primary` and :attr:`primary_power` read it.
        families: the study's declared families (:class:`~sur_lab.analysis.decisions.Family`), the primary first.
        table_file: the table the sweep writes in its folder. distributed: whether Ray workers may run it.
    """

    name: ClassVar[str]
    notebook: ClassVar[str]
    folder_prefix: ClassVar[str]
    presets: ClassVar[Mapping[str, Mapping[str, Any]]]
    fixed: ClassVar[Mapping[str, Any]]
    folder_keys: ClassVar[Mapping[str, str | Callable[[Mapping[str, Any]], Any]]]
    scorer: ClassVar[Callable[[Any, str], bool] | None] = None
    parser: ClassVar[Callable[[str], Any] | None] = None
    power: ClassVar[Any]
    families: ClassVar[tuple] = ()
    table_file: ClassVar[str] = "records.parquet"
    distributed: ClassVar[bool] = True

    # -- declarations the subclass implements ------------------------------------------------------------------------

    @abstractmethod
    def cases(self, tokenizer, params: Mapping[str, Any], seed: int = 0) -> Any:
        """The study's cases for ``params`` (by tokenization alone, before any model runs): what its notebook
        shows and :meth:`sweep_cases` turns into :class:`sur_lab.sweeps.Case` objects."""

    @abstractmethod
    def methods(self, params: Mapping[str, Any]) -> list:
        """The sweep's methods for ``params`` (names or :class:`sur_lab.sweeps.Method` objects)."""

    @abstractmethod
    def report(self, records, params: Mapping[str, Any], *, decide: bool = True) -> Report:
        """The study's tables, figures and conclusion lines from its records (wrapping its report functions).
        ``decide``: ``False`` at a plumbing-check size (:func:`sur_lab.analysis.decisions.decides`), where every
        verdict is "not decided"."""

    # -- written once ------------------------------------------------------------------------------------------------

    def params(self, preset: str = "default", **overrides: Any) -> dict[str, Any]:
        """The study's parameters at ``preset``: its sizes (:attr:`presets`) and :attr:`fixed`, overrides applied
        (``None`` keeps the default; :func:`sur_lab.studies.presets.study_params`).

        Raises:
            ValueError: naming ``preset`` or an unknown parameter.
        """
        from sur_lab.studies.presets import study_params

        return study_params(self.presets, self.fixed, preset, **overrides)

    def default_executor(self, params: Mapping[str, Any]) -> str:
        """The executor of a run that names none: the ``executor`` parameter when the study has one, else
        ``"sequential"``."""
        return params.get("executor", "sequential")

    def folder_tag(self, params: Mapping[str, Any], *, seed: int = 0, eval_batch: int | None = None,
                   executor: str | None = None) -> dict[str, Any]:
        """The folder name's entries (:attr:`folder_keys` resolved against ``params`` and the run arguments; ``ex``
        appended when the executor is not the sequential one and the keys do not list it)."""
        from sur_lab.sweeps import EVAL_BATCH

        run = {"seed": seed, "eval_batch": EVAL_BATCH if eval_batch is None else eval_batch,
               "executor": executor or self.default_executor(params)}
        merged = {**params, **run}
        tag = {k: (v(merged) if callable(v) else merged[v]) for k, v in self.folder_keys.items()}
        if "ex" not in tag and run["executor"] != "sequential":
            tag["ex"] = run["executor"]
        return tag

    def folder(self, lm, params: Mapping[str, Any], *, seed: int = 0, eval_batch: int | None = None,
               executor: str | None = None, outputs: Path | None = None) -> Path:
        """The sweep folder of ``params`` (:func:`sur_lab.sweeps.sweep_folder`: the prefix, :meth:`folder_tag` and the
        model's fingerprint), so the notebook and ``sur-lab sweep NAME`` with the same parameters resume each other's
        records."""
        from sur_lab.sweeps import sweep_folder

        return sweep_folder(self.folder_prefix, lm, outputs=outputs,
                            **self.folder_tag(params, seed=seed, eval_batch=eval_batch, executor=executor))

    def check(self, params: Mapping[str, Any]) -> None:
        """Refuse bad parameters before any model call (the sweep and ``sur-lab sweep`` call it): the methods and
        budgets (:func:`sur_lab.sweeps.method_grid`).

        Raises:
            ValueError: naming the bad method or budget.
        """
        from sur_lab.sweeps import method_grid

        method_grid(self.methods(params), self.budgets(params))

    def budgets(self, params: Mapping[str, Any]) -> Sequence[float]:
        """The budgets (%) every budgeted method runs at: ``params["budgets"]``."""
        return params.get("budgets", ())

    def sweep_cases(self, cases: Any, params: Mapping[str, Any]) -> list:
        """The :class:`sur_lab.sweeps.Case` objects of :meth:`cases` (default: each case's ``sweep_case()``)."""
        return [c.sweep_case() for c in cases]

    def timed(self, cases: Any, params: Mapping[str, Any]) -> bool | list[str]:
        """Which cases have their answers timed (:func:`sur_lab.sweeps.run_sweep`'s ``timed``; default none)."""
        return False

    def scorer_for(self, cases: Any) -> Callable[[Any, str], bool] | None:
        """The scorer of these cases (default :attr:`scorer`)."""
        return type(self).scorer

    def options(self, params: Mapping[str, Any]) -> dict[str, Any] | None:
        """The sweep's method options (:func:`sur_lab.sweeps.run_sweep`; default none)."""
        return None

    def run(self, lm, cases: Any, params: Mapping[str, Any], where: Path, **run: Any):
        """The records of ``cases`` in ``where``: :func:`sur_lab.sweeps.run_sweep` of :meth:`sweep_cases`,
        :meth:`methods` and :meth:`budgets`, with ``run`` (seed, executor, eval_batch, workers, threads, address,
        progress, share_prefix)."""
        from sur_lab.sweeps import run_sweep

        return run_sweep(lm, self.sweep_cases(cases, params), self.methods(params), self.budgets(params), where,
                         max_new_tokens=params["max_new_tokens"], timed=self.timed(cases, params),
                         scorer=self.scorer_for(cases), parser=type(self).parser, options=self.options(params), **run)

    def finish(self, lm, records, cases: Any, params: Mapping[str, Any], where: Path, **run: Any):
        """The records after the sweep (default: as they are); a study that writes more beside them does it here."""
        return records

    def sweep(self, lm, *, preset: str = "default", out: Path | str | None = None, seed: int = 0, workers: int = 1,
              threads: int | None = None, address: str | None = None, executor: str | None = None,
              eval_batch: int | None = None, progress: bool = True, share_prefix: bool = True, cases: Any = None,
              **overrides: Any) -> SweepResult:
        """Run (or resume) the study's sweep.

        Args:
            lm: the model (a :class:`sur_lab.models.LoadedModel`; Ray actors reload it by name, dtype and device).
            preset, overrides: the parameters (:meth:`params`).
            out: the sweep folder (default :meth:`folder`).
            seed: case selection and allocator seed.
            workers, threads, address: Ray actors (:func:`sur_lab.sweeps.run_sweep`); ``workers=1``: this process.
            executor: sparse-refresh executor (default :meth:`default_executor`).
            eval_batch: records answered together in untimed cases (default :data:`sur_lab.sweeps.EVAL_BATCH`).
            progress: show a progress bar.
            share_prefix: exact prefix sharing inside each case (:func:`sur_lab.sweeps.run_case`; default on).
            cases: the :meth:`cases` of these parameters, seed and tokenizer when the caller built them already (a
                notebook that shows its roster before the sweep); default: built here.

        Returns:
            A :class:`SweepResult`: ``(records, folder, cases)``.

        Raises:
            ValueError: naming a bad parameter, ``workers`` or ``address`` (a study that is not :attr:`distributed`),
                before any model call; or as :func:`sur_lab.sweeps.run_sweep`.
        """
        from sur_lab.sweeps import EVAL_BATCH

        if not self.distributed and (workers != 1 or address is not None):
            raise ValueError(f"workers={workers}, address={address!r}: the {self.name} study times requests one at a "
                             "time in one process; use workers=1 and no address")
        p = self.params(preset, **overrides)
        self.check(p)
        executor = executor or self.default_executor(p)
        eval_batch = EVAL_BATCH if eval_batch is None else eval_batch
        built = self.cases(lm.tokenizer, p, seed) if cases is None else cases
        where = Path(out) if out is not None else self.folder(lm, p, seed=seed, eval_batch=eval_batch,
                                                              executor=executor)
        run = {"seed": seed, "executor": executor, "eval_batch": eval_batch, "workers": workers, "threads": threads,
               "address": address, "progress": progress, "share_prefix": share_prefix}
        records = self.run(lm, built, p, where, **run)
        return SweepResult(self.finish(lm, records, built, p, where, **run), where, built)

    @property
    def primary(self):
        """The primary comparison's :class:`~sur_lab.analysis.decisions.Family` (:attr:`power`'s)."""
        return self.power.family

    @property
    def primary_power(self):
        """The primary comparison's stated :class:`~sur_lab.analysis.decisions.PowerBasis` (:attr:`power`'s)."""
        return self.power.basis

    def mde(self, params: Mapping[str, Any]) -> tuple[float, str]:
        """The primary comparison's minimal detectable effect at 80 % power, two-sided 5 %, at the size of ``params``
        and the stated basis: ``(effect, unit)`` (:meth:`sur_lab.analysis.decisions.PowerDesign.mde`; NaN when the
        size cannot reach 80 %)."""
        return self.power.mde(params)

    def power_line(self, params: Mapping[str, Any]) -> str:
        """:meth:`mde` in words, for the notebook's "This run" cell
        (:meth:`sur_lab.analysis.decisions.PowerDesign.line`)."""
        return self.power.line(params)

    def conclusion(self, records, params: Mapping[str, Any], *, preset: str | None = None) -> list[str]:
        """The notebook's closing lines: the smoke banner on a smoke run, the power statement (:meth:`power_line`),
        then the report's conclusion lines (:meth:`report`, deciding only where the notebook does:
        ``decide=decides(preset)``, so a smoke run's verdicts are "not decided")."""
        from sur_lab.analysis.decisions import decides
        from sur_lab.studies.presets import smoke_banner

        banner = smoke_banner(preset)
        lines = self.report(records, params, decide=decides(preset)).conclusion
        return [*([banner] if banner else []), self.power_line(params), *lines]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} (notebook {self.notebook})>"


__all__ = ["RUN_ARGUMENTS", "Report", "Study", "SweepResult"]
