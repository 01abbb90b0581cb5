"""Notebook parameter validation: one call after the ``parameters`` cell checks every parameter against its annotation.

Every notebook's ``parameters`` cell is a list of annotated literals (``budgets: list = [2, 5]``). Papermill replaces
values without looking at the annotations, so ``-p datasets '["a","b"]'`` arrives as the *string* ``'["a","b"]'`` and
a notebook would iterate over its characters. The cell after the parameters (and papermill's injected parameters)
calls::

    from sur_lab.runtime.params import validate_parameters
    validate_parameters(globals())

which checks each annotated parameter's value against its annotation, parses a string given for a ``list`` (or
``dict``) as JSON, then as YAML, and refuses anything else with a message that names the parameter and shows the
spelling that works (papermill's ``-y``, or ``sur-lab run -p`` with a Python/JSON literal).
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping, MutableMapping
from typing import Any

#: Annotations this module checks; parameters annotated otherwise are left alone.
CHECKED_TYPES = (bool, int, float, str, list, dict, tuple)
_BY_NAME = {t.__name__: t for t in CHECKED_TYPES}


class ParameterError(TypeError):
    """A notebook parameter does not match its annotation (the message names it and shows a working spelling)."""


def _spelling(name: str, value: Any, kind: type) -> str:
    example = '["a", "b"]' if kind is list else '{"key": 1}'
    if isinstance(value, str) and value.strip()[:1] in "[{":
        example = value.strip()
    return (
        f"pass a {kind.__name__} with papermill's YAML option: papermill IN.ipynb OUT.ipynb -y '{name}: {example}' "
        f"(or: sur-lab run NOTEBOOK -p {name} '{example}')"
    )


def _parse_container(name: str, text: str, kind: type) -> Any:
    """A list/dict parsed from ``text`` as JSON, then YAML; ParameterError when neither gives a ``kind``."""
    parsed: Any = None
    try:
        parsed = json.loads(text)
    except ValueError:
        try:
            import yaml

            parsed = yaml.safe_load(text)
        except Exception:  # noqa: BLE001 - any YAML error means "not a list"
            parsed = None
    if kind is tuple and isinstance(parsed, list):
        parsed = tuple(parsed)
    if not isinstance(parsed, kind):
        raise ParameterError(
            f"parameter {name!r} must be a {kind.__name__}; got the string {text!r}, which is not a JSON/YAML "
            f"{kind.__name__} (papermill's -p passes strings). {_spelling(name, text, kind)}"
        )
    return parsed


def _allowed(annotation: Any) -> tuple[tuple[type, ...], bool] | None:
    """The checkable types of an annotation and whether None is allowed; None when the annotation is not checked."""
    if isinstance(annotation, str):  # postponed annotations (``from __future__ import annotations``)
        if annotation.replace(" ", "").endswith("|None"):
            inner = _allowed(annotation.replace(" ", "")[: -len("|None")])
            return (inner[0], True) if inner else None
        annotation = _BY_NAME.get(annotation.split("[")[0].strip())
        if annotation is None:
            return None
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(annotation)
        allow_none = type(None) in members
        kinds = tuple(typing.get_origin(m) or m for m in members if m is not type(None))
        kinds = tuple(k for k in kinds if k in CHECKED_TYPES)
        return (kinds, allow_none) if kinds else None
    base = origin or annotation
    return ((base,), False) if base in CHECKED_TYPES else None


def _matches(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def check_parameter(name: str, value: Any, annotation: Any) -> Any:
    """Return ``value`` checked against ``annotation`` (a string for a list/dict/tuple parsed as JSON or YAML; an int for
    a float converted).

    Raises:
        ParameterError: naming the parameter, the expected type, the value given and a spelling that works.
    """
    allowed = _allowed(annotation)
    if allowed is None:
        return value
    kinds, allow_none = allowed
    if value is None and allow_none:
        return value
    for kind in kinds:
        if _matches(value, kind):
            return float(value) if kind is float and not isinstance(value, float) else value
    containers = [k for k in kinds if k in (list, dict, tuple)]
    if isinstance(value, str) and containers:
        return _parse_container(name, value, containers[0])
    expected = " or ".join(k.__name__ for k in kinds) + (" or None" if allow_none else "")
    hint = f" {_spelling(name, value, containers[0])}" if containers else ""
    raise ParameterError(
        f"parameter {name!r} must be {expected}; got {type(value).__name__} {value!r}.{hint}"
    )


def validate_parameters(
    namespace: MutableMapping[str, Any],
    annotations: Mapping[str, Any] | None = None,
    *,
    optional: tuple[str, ...] | list[str] = (),
) -> None:
    """Check every annotated parameter in ``namespace`` (a notebook's ``globals()``) once, after the parameters cell.

    Values are replaced in ``namespace`` when a string given for a list/dict/tuple is parsed (JSON, then YAML) or an
    int given for a float is converted; a note is printed for each parsed string.

    Args:
        namespace: the notebook's globals (papermill's injected values already applied).
        annotations: name -> annotation; default ``namespace["__annotations__"]`` (the parameters cell's annotated
            assignments).
        optional: parameters that may also be ``None`` (e.g. "from the preset"). papermill's parameter parser reads
            only plain annotations (``budgets: list = None``, not ``list | None``), so a notebook names them here.

    Raises:
        ParameterError: listing every parameter whose value does not match its annotation (all are checked before
            anything is replaced, so a failing call changes nothing).
    """
    annotations = dict(annotations if annotations is not None else namespace.get("__annotations__", {}))
    checked: dict[str, Any] = {}
    errors: list[str] = []
    for name, annotation in annotations.items():
        if name not in namespace:
            continue
        if name in optional and namespace[name] is None:
            continue
        try:
            checked[name] = check_parameter(name, namespace[name], annotation)
        except ParameterError as err:
            errors.append(str(err))
    if errors:
        raise ParameterError("\n".join(errors))
    for name, value in checked.items():
        if value is not namespace[name]:
            if isinstance(namespace[name], str):
                print(f"parameter {name}: parsed the string {namespace[name]!r} as {value!r}")
            namespace[name] = value


#: The cell every notebook runs right after its parameters cell (and papermill's injected parameters).
VALIDATION_CELL = "from sur_lab.runtime.params import validate_parameters\n\nvalidate_parameters(globals())"
