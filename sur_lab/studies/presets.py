"""Study sizes by name: ``smoke`` (seconds, CI), ``default`` (decides on the Qwen study model) and ``paper`` (the
paper's grid). Each study module holds its own ``PRESETS`` table; notebooks 02, 03 and 06 take a ``preset`` parameter
and leave their size parameters at ``None`` unless the user overrides one (issue 13)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

PRESET_NAMES = ("smoke", "default", "paper")
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
