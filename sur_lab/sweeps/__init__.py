"""Sweeps: the experiment pipeline every study runs through (``docs/pipeline.md``).

* :mod:`~sur_lab.sweeps.record`: :class:`Record`, the one schema of a sweep record (JSON lines, Parquet rows).
* :mod:`~sur_lab.sweeps.case`: :class:`Case` and :func:`run_case`, the only place that turns one case into records.
* :mod:`~sur_lab.sweeps.store`: :class:`SweepStore`, part files (records, or keyed rows), the fingerprint check,
  ``sweep.json``, ``records.parquet``, resume; :func:`sweep_folder` names a folder per study, parameters and model fingerprint.
* :mod:`~sur_lab.sweeps.local` and :mod:`~sur_lab.sweeps.ray`: schedulers (this process, Ray actors).
* :mod:`~sur_lab.sweeps.run`: :func:`run_sweep`, which checks the arguments and picks a scheduler.

Layer: above ``analysis`` (scoring, endpoints) and the core, below ``studies`` (which build cases and call
:func:`run_sweep`). Importing this package does not import Ray.
"""

from sur_lab.sweeps.case import (
    EVAL_BATCH,
    Case,
    Method,
    answer_target,
    case_fingerprint,
    case_seed,
    grid_keys,
    make_scorer,
    method_grid,
    run_case,
)
from sur_lab.sweeps.record import (
    ANSWER_TIMING_FIELDS,
    CONDITION_FIELDS,
    FIELD_NAMES,
    TIMING_FIELDS,
    Record,
    comparable_fields,
    parse_line,
    record_key,
    records_frame,
)
from sur_lab.sweeps.run import run_sweep, seeded_subset, timed_set
from sur_lab.sweeps.store import FolderInUseError, SweepStore, read_records, sweep_folder

__all__ = [
    "ANSWER_TIMING_FIELDS", "CONDITION_FIELDS", "EVAL_BATCH", "FIELD_NAMES", "TIMING_FIELDS", "Case", "FolderInUseError",
    "Method",
    "Record", "SweepStore", "answer_target", "case_fingerprint", "case_seed", "comparable_fields", "grid_keys", "make_scorer", "method_grid",
    "parse_line", "read_records",
    "record_key", "records_frame", "run_case", "run_sweep", "seeded_subset", "sweep_folder", "timed_set",
]
