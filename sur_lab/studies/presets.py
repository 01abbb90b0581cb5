"""Study sizes by name: ``smoke`` (seconds, CI), ``default`` (decides on the Qwen study model) and ``paper`` (the
paper's grid). Each study module holds its own ``PRESETS`` table and ``FIXED`` defaults; notebooks 02, 03 and 06 take a
``preset`` parameter and leave their size parameters at ``None`` unless the user overrides one (issue 13).
:func:`study_params` resolves a study's parameters from both, as its ``sweep()`` and the ``sur-lab sweep`` command do."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

PRESET_NAMES = ("smoke", "default", "paper")
#: How the notebook runner tells a kernel which preset it runs (``smoke`` for ``--smoke`` and ``sur-lab run --preset
#: smoke``), for the notebooks whose sizes are parameters of their own rather than a ``preset`` parameter.
PRESET_ENV = "SUR_LAB_PRESET"
#: What a smoke run is: printed above each notebook's "This run" summary and on the results page.
SMOKE_BANNER = "plumbing check: sizes too small to decide anything"
#: The study model of the ``default`` and ``paper`` presets (the notebooks' ``model_name`` default): the embedded
#: Qwen2.5-Coder-0.5B-Instruct. ``smoke`` runs the embedded SmolLM2-135M-Instruct (``load_model(None)``).
STUDY_MODEL = "qwen2.5-coder-0.5b"
#: Re-prefill's EM (fraction of cases) from which EM leads the tables and agreement with Re-prefill stands beside it;
#: below it EM cannot separate methods and agreement leads (issue 13).
EM_LEAD_MIN = 0.3


def resolve_preset(presets: Mapping[str, Mapping[str, Any]], preset: str, **overrides: Any) -> dict[str, Any]:
    """The sizes of ``preset`` with every override that is not ``None`` applied.

    Args:
        presets: a study's ``PRESETS`` table (name -> sizes).
        preset: one of :data:`PRESET_NAMES`.
        **overrides: size values from the notebook; ``None`` keeps the preset's value.

    Returns:
        A new dict of sizes.

    Raises:
        ValueError: naming ``preset`` when unknown, or the override that the preset does not define.
    """
    if preset not in presets:
        raise ValueError(f"preset={preset!r} is not one of {', '.join(presets)}")
    sizes = dict(presets[preset])
    for key, value in overrides.items():
        if key not in sizes:
            raise ValueError(f"{key} is not a size of this study's presets; sizes: {', '.join(sizes)}")
        if value is not None:
            sizes[key] = value
    return sizes


def preset_model(preset: str) -> str | None:
    """The model a study runs at ``preset`` unless told otherwise: ``None`` (the embedded SmolLM2) for ``smoke``,
    :data:`STUDY_MODEL` for ``default`` and ``paper``.

    Raises:
        ValueError: naming ``preset`` when it is not one of :data:`PRESET_NAMES`.
    """
    if preset not in PRESET_NAMES:
        raise ValueError(f"preset={preset!r} is not one of {', '.join(PRESET_NAMES)}")
    return None if preset == "smoke" else STUDY_MODEL


def lead_endpoint(reprefill_em: float, *, em: str = "em", agreement: str = "agree_reprefill") -> str:
    """``em`` when Re-prefill's EM (fraction of cases) is at least :data:`EM_LEAD_MIN`, else ``agreement``."""
    return em if not math.isnan(reprefill_em) and reprefill_em >= EM_LEAD_MIN else agreement


def study_params(presets: Mapping[str, Mapping[str, Any]], fixed: Mapping[str, Any], preset: str = "default",
                 **overrides: Any) -> dict[str, Any]:
    """A study's parameters: the sizes of ``preset`` and the ``fixed`` defaults, with every override that is not
    ``None`` applied (lists copied, so the caller may change them).

    Args:
        presets: the study's ``PRESETS`` table (name -> sizes).
        fixed: the study's other parameters at their defaults (the notebook's ``parameters`` cell literals).
        preset: one of :data:`PRESET_NAMES`.
        **overrides: parameter values; ``None`` keeps the preset's or the default.

    Raises:
        ValueError: naming ``preset`` when unknown, or an override that is not one of the study's parameters (listing
            them).
    """
    if preset not in presets:
        raise ValueError(f"preset={preset!r} is not one of {', '.join(presets)}")
    known = {**dict(fixed), **dict(presets[preset])}
    unknown = [k for k in overrides if k not in known]
    if unknown:
        raise ValueError(f"{unknown[0]} is not a parameter of this study; parameters: {', '.join(known)}")
    out = {**known, **{k: v for k, v in overrides.items() if v is not None}}
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in out.items()}


def is_smoke(preset: str | None = None) -> bool:
    """Whether this run is a smoke run: ``preset == "smoke"`` when a notebook passes its ``preset`` parameter, else
    what the notebook runner said (``$SUR_LAB_PRESET``, :data:`PRESET_ENV`)."""
    return (preset if preset is not None else os.environ.get(PRESET_ENV)) == "smoke"


def smoke_banner(preset: str | None = None) -> str:
    """The banner a smoke run prints above its "This run" summary ("" for any other run): the sizes were chosen to
    show that every step runs, not to decide anything, whatever the verdicts below it say."""
    if not is_smoke(preset):
        return ""
    return (f"SMOKE RUN ({SMOKE_BANNER}): this page shows that every step runs, at toy sizes; read no result "
            "from it. The default preset (make notebooks) runs the study.")


def show_smoke_banner(preset: str | None = None) -> None:
    """Print :func:`smoke_banner` when this is a smoke run; the one call every notebook makes before its "This run"
    summary (``preset``: the notebook's ``preset`` parameter, when it has one)."""
    banner = smoke_banner(preset)
    if banner:
        print(banner)
