"""Notebook parameter validation: one call after the ``parameters`` cell checks every parameter against its annotation.
(The command line's argparse types, :func:`int_arg` and :func:`budget_arg`, live here too: one owner of a parameter's
range check.)

Every notebook's ``parameters`` cell is a list of annotated literals (``budgets: list = [2, 5]``). Papermill replaces
values without looking at the annotations, so ``-p datasets '["a","b"]'`` arrives as the *string* ``'["a","b"]'`` and
a notebook would iterate over its characters. The cell after the parameters (and papermill's injected parameters)
calls::

    from sur_lab.runtime.params import validate_parameters
    validate_parameters(globals())

which checks each annotated parameter's value against its annotation, parses a string given for a ``list`` (or
``dict``) as JSON, then as YAML, and refuses anything else with a message that names the parameter and shows the
spelling that works (papermill's ``-y``, or ``sur-lab run -p`` with a Python/JSON literal).

Declared ranges. A parameter's comment may declare the values it allows in braces, which ``papermill
--help-notebook`` shows with the rest of the comment::

    example_index: int = 0  # which example of the file {0..}
    budgets: list = [2, 5]  # SUR budgets, % of the suffix {0..100, len 1..}
    overlap_budget: float = 5.0  # b, % of the suffix {> 0, ..100}
    preset: str = "default"  # study size {"smoke" | "default" | "paper"}

Terms, separated by commas: ``a..b`` (from a to b, both included), ``a..`` (a or more), ``..b`` (b or less), ``> a``,
``< b`` (strict), ``len a..b`` / ``len a..`` (the length of a list), or quoted choices separated by ``|``. (No ``=``
sign: papermill's parameter parser skips a line that holds two.) For a list the bounds and choices apply to every item;
``None`` (a parameter "from the preset") is always allowed where the type allows it. A value outside its range is a
:class:`ParameterRangeError` (a ``ValueError`` and a :class:`ParameterError`) naming the parameter, the allowed range
and the value. The ranges are checked twice, both times before the study's cells run: by the runners (``sur-lab run``,
``python -m sur_lab.runtime.run_notebooks``), which read the notebook's ``parameters`` cell
(:func:`check_notebook_parameters`) before any notebook starts, and by ``validate_parameters(globals())`` inside the
kernel (for a plain ``papermill`` run), which reads the parameters cell from IPython's input history.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import math
import re
import tokenize
import types
import typing
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

#: Annotations this module checks; parameters annotated otherwise are left alone.
CHECKED_TYPES = (bool, int, float, str, list, dict, tuple)
_BY_NAME = {t.__name__: t for t in CHECKED_TYPES}


class ParameterError(TypeError):
    """A notebook parameter does not match its annotation (the message names it and shows a working spelling)."""


class ParameterRangeError(ParameterError, ValueError):
    """A notebook parameter has the right type but lies outside the range its comment declares."""


_NUMBER = r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"  # 0, 2.5, 1e-3 (no bare dots: "0...1" is refused)
_STRICT = re.compile(rf"^(>|<)\s*({_NUMBER})$")
_INTERVAL = re.compile(rf"^({_NUMBER})?\s*\.\.\s*({_NUMBER})?$")
_LENGTH = re.compile(r"^len\s+(\d+)?\s*\.\.\s*(\d+)?$")
_CHOICES = re.compile(r'^"[^"]*"(?:\s*\|\s*"[^"]*")*$')
_SPEC = re.compile(r"\{([^{}]*)\}")


def _compare(op: str, x: float, bound: float) -> bool:
    return {">=": x >= bound, ">": x > bound, "<=": x <= bound, "<": x < bound}[op]


@dataclass(frozen=True)
class ParameterRange:
    """The values a notebook parameter allows, parsed from ``{...}`` in its comment (module docstring).

    Attributes:
        spec: the declaration as written (without braces).
        bounds: ``(op, number)`` comparisons every value (every item of a list) must satisfy.
        choices: allowed strings, or ``None``.
        length: ``(op, n)`` comparisons the length of a list must satisfy.
    """

    spec: str
    bounds: tuple[tuple[str, float], ...] = ()
    choices: tuple[str, ...] | None = None
    length: tuple[tuple[str, int], ...] = ()

    @classmethod
    def parse(cls, spec: str, name: str = "?") -> "ParameterRange":
        """Parse a declaration; ValueError naming the parameter when it does not follow the grammar."""
        text = spec.strip()
        if _CHOICES.match(text):
            return cls(text, choices=tuple(re.findall(r'"([^"]*)"', text)))
        bounds: list[tuple[str, float]] = []
        length: list[tuple[str, int]] = []
        for term in (t.strip() for t in text.split(",")):
            if m := _STRICT.match(term):
                bounds.append((m[1], float(m[2])))
            elif (m := _INTERVAL.match(term)) and (m[1] or m[2]):
                bounds += [(">=", float(m[1]))] if m[1] else []
                bounds += [("<=", float(m[2]))] if m[2] else []
            elif (m := _LENGTH.match(term)) and (m[1] or m[2]):
                length += [(">=", int(m[1]))] if m[1] else []
                length += [("<=", int(m[2]))] if m[2] else []
            else:
                raise ValueError(f"parameter {name!r}: cannot read the declared range {{{spec}}} (term {term!r}); "
                                 "write e.g. {0..}, {1..10}, {> 0, ..100}, {len 1..} or {\"a\" | \"b\"}")
        return cls(text, tuple(bounds), None, tuple(length))

    def describe(self) -> str:
        """The allowed values in words (``>= 0``, ``in [0, 100]``, ``one of 'a', 'b'``)."""
        parts = []
        if self.choices is not None:
            parts.append("one of " + ", ".join(repr(c) for c in self.choices))
        lo = [b for b in self.bounds if b[0] in (">=", ">")]
        hi = [b for b in self.bounds if b[0] in ("<=", "<")]
        if len(lo) == 1 and len(hi) == 1:
            (lo_op, lo_v), (hi_op, hi_v) = lo[0], hi[0]
            parts.append(f"in {'[' if lo_op == '>=' else '('}{_fmt(lo_v)}, {_fmt(hi_v)}{']' if hi_op == '<=' else ')'}")
        else:
            parts += [f"{op} {_fmt(v)}" for op, v in self.bounds]
        return " and ".join(parts)

    def check(self, name: str, value: Any) -> None:
        """Raise :class:`ParameterRangeError` when ``value`` (a checked parameter value) is outside the range."""
        if value is None:
            return
        if isinstance(value, (list, tuple)):
            for op, n in self.length:
                if not _compare(op, len(value), n):
                    raise ParameterRangeError(f"parameter {name!r} must hold a list with len {op} {n} (declared "
                                              f"{{{self.spec}}}); got {len(value)} items: {value!r}")
            for index, item in enumerate(value):
                self._check_item(name, item, f" (item {index} of {value!r})", "hold values ")
            return
        self._check_item(name, value, "", "be ")

    def _check_item(self, name: str, value: Any, where: str, verb: str) -> None:
        if self.choices is not None and value not in self.choices:
            raise ParameterRangeError(f"parameter {name!r} must {verb}{self.describe()} (declared {{{self.spec}}}); "
                                      f"got {_short(value)}{where}")
        if not self.bounds:
            return
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        # math.isnan(int) converts to float: an int beyond float's range is refused here, not an OverflowError.
        if not number or (isinstance(value, float) and math.isnan(value)) or not all(
            _compare(op, value, b) for op, b in self.bounds
        ):
            raise ParameterRangeError(f"parameter {name!r} must {verb}{self.describe()} (declared {{{self.spec}}}); "
                                      f"got {_short(value)}{where}")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _annotated(source: str) -> list[tuple[ast.AnnAssign, str]]:
    """The annotated assignments of a cell's source with the comment on their line ("" when none)."""
    tree = ast.parse(source)
    comments: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string
    except (tokenize.TokenError, IndentationError):
        pass
    return [(node, comments.get(node.end_lineno, comments.get(node.lineno, "")))
            for node in tree.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]


def parse_ranges(source: str) -> dict[str, ParameterRange]:
    """Declared ranges of a ``parameters`` cell: ``{name: ParameterRange}`` for every parameter whose comment holds
    ``{...}`` (module docstring).

    Raises:
        ValueError: naming the parameter when its declaration does not follow the grammar, or holds two.
        SyntaxError: when ``source`` is not Python.
    """
    ranges = {}
    for node, comment in _annotated(source):
        specs = _SPEC.findall(comment)
        if len(specs) > 1:
            raise ValueError(f"parameter {node.target.id!r} declares {len(specs)} ranges in its comment; one only")
        if specs:
            ranges[node.target.id] = ParameterRange.parse(specs[0], node.target.id)
    return ranges


def _history_ranges(namespace: Mapping[str, Any]) -> dict[str, ParameterRange]:
    """Ranges declared in the cells IPython has run so far (``In``), later cells overriding earlier ones."""
    ranges: dict[str, ParameterRange] = {}
    for source in namespace.get("In") or []:
        if not isinstance(source, str) or ":" not in source or "{" not in source:
            continue
        try:
            ranges.update(parse_ranges(source))
        except SyntaxError:
            continue
    return ranges


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
            if kind is float and not isinstance(value, float):
                try:
                    return float(value)
                except OverflowError:
                    raise ParameterError(f"parameter {name!r} must be a float; {value!r:.40} is beyond float's range "
                                         f"(about 1.8e308)") from None
            return value
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
    ranges: Mapping[str, ParameterRange] | None = None,
) -> None:
    """Check every annotated parameter in ``namespace`` (a notebook's ``globals()``) once, after the parameters cell:
    its type against its annotation, then its value against its declared range.

    Values are replaced in ``namespace`` when a string given for a list/dict/tuple is parsed (JSON, then YAML) or an
    int given for a float is converted; a note is printed for each parsed string.

    Args:
        namespace: the notebook's globals (papermill's injected values already applied).
        annotations: name -> annotation; default ``namespace["__annotations__"]`` (the parameters cell's annotated
            assignments).
        optional: parameters that may also be ``None`` (e.g. "from the preset"). papermill's parameter parser reads
            only plain annotations (``budgets: list = None``, not ``list | None``), so a notebook names them here.
        ranges: name -> :class:`ParameterRange`; default: the ranges declared in the comments of the cells the
            IPython kernel has run (``namespace["In"]``: the parameters cell), none outside IPython.

    Raises:
        ParameterError: listing every parameter whose value does not match its annotation or (a
            :class:`ParameterRangeError` when every problem is a range) lies outside its declared range; all are
            checked before anything is replaced, so a failing call changes nothing.
    """
    ranges = dict(ranges) if ranges is not None else _history_ranges(namespace)
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
            if name in ranges:
                ranges[name].check(name, checked[name])
        except ParameterError as err:
            errors.append(err)
    if errors:
        kind = ParameterRangeError if all(isinstance(e, ParameterRangeError) for e in errors) else ParameterError
        raise kind("\n".join(map(str, errors)))
    for name, value in checked.items():
        if value is not namespace[name]:
            if isinstance(namespace[name], str):
                print(f"parameter {name}: parsed the string {namespace[name]!r} as {value!r}")
            namespace[name] = value


def parameters_cell(path: str | Path) -> str:
    """The source of the notebook's cell tagged ``parameters`` ("" when it has none)."""
    cells = json.loads(Path(path).read_text(encoding="utf-8")).get("cells", [])
    return next(("".join(c.get("source", "")) for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])),
                "")


def literal_defaults(source: str) -> dict[str, Any]:
    """The literal defaults a ``parameters`` cell's source assigns, by name (assignments whose value is not a literal
    are left out; nothing is executed)."""
    out: dict[str, Any] = {}
    for node in ast.parse(source).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign)
                                                                      else None)
        if isinstance(target, ast.Name) and getattr(node, "value", None) is not None:
            try:
                out[target.id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def check_notebook_parameters(path: str | Path, parameters: Mapping[str, Any] | None = None) -> None:
    """Check a notebook run's parameters before it starts: every annotated parameter of its ``parameters`` cell, at
    its default or as overridden by ``parameters``, against its annotation and its declared range.

    A parameter whose default is ``None`` ("from the preset") may stay ``None``. Defaults that are not literals are
    checked only when overridden. Nothing is executed: the cell is read with ``ast``.

    Raises:
        ParameterError: naming the notebook and listing every parameter that fails (a
            :class:`ParameterRangeError` when all failures are ranges); ValueError when a declared range does not
            parse.
    """
    source = parameters_cell(path)
    if not source:
        return
    ranges = parse_ranges(source)
    given = dict(parameters or {})
    errors: list[ParameterError] = []
    for node, _ in _annotated(source):
        name = node.target.id
        annotation = ast.unparse(node.annotation)
        try:
            default = ast.literal_eval(node.value) if node.value is not None else None
            literal = node.value is not None
        except ValueError:
            default, literal = None, False
        if name not in given and not literal:
            continue
        value = given.get(name, default)
        if value is None and literal and default is None:
            continue  # "None: from the preset"
        try:
            checked = check_parameter(name, value, annotation)
            if name in ranges:
                ranges[name].check(name, checked)
        except ParameterError as err:
            errors.append(err)
    if errors:
        kind = ParameterRangeError if all(isinstance(e, ParameterRangeError) for e in errors) else ParameterError
        raise kind(f"{Path(path).name}: " + "\n".join(map(str, errors)))


# argparse types of the command line (sur-lab and its benchmark)


def int_arg(name: str, low: int = 1, *, zero: bool = False):
    """An argparse ``type=``: an integer >= ``low`` (or exactly 0 when ``zero``); the message names ``name``.

    Shared by the ``sur-lab`` subcommands, ``sur-lab bench`` (:mod:`sur_lab.runtime.bench`) and the scripts.
    """
    allowed = f"0 or an integer >= {low}" if zero else f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {allowed}; got {text!r}") from None
        if value < low and not (zero and value == 0):
            raise argparse.ArgumentTypeError(f"{name} must be {allowed}; got {text!r}")
        return value

    return parse


def budget_arg(name: str, *, zero: bool = False):
    """An argparse ``type=``: a budget b in (0, 100] % of the suffix (``[0, 100]`` when ``zero``: Shift's 0 % allowed);
    the message names ``name``."""
    allowed = "[0, 100]" if zero else "(0, 100]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be numbers in {allowed} (%); got {text!r}") from None
        if not (0 <= value <= 100 if zero else 0 < value <= 100):
            raise argparse.ArgumentTypeError(f"{name} must be numbers in {allowed} (%); got {text!r}")
        return value

    return parse
