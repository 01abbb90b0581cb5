"""The allocator interface: every allocation rule gets the same request and returns an exact-B support.

An allocator is a function ``fn(request: AllocationRequest) -> Selection`` registered under the name the paper uses
(``"SUR"``, ``"Dense tokens"``, ...). :func:`allocate` validates the name before any work, times the call
(``select_ms``, wall clock) and checks the exact-allowance contract of Eq. 3. Source: Algorithm 1, appendix 7.1, 7.4.

The allowance B has one source of truth, :attr:`AllocationRequest.allowance`: either the exact count given as
``allowance=`` (the matched-token protocol, appendix 9.3) or Eq. 3's ``B(S, b)`` from ``budget_pct`` (on the
whole-prompt base of appendix 9.3 when ``allowance_base="prompt"``). Every allocator selects exactly that many.

Options and variants. An allocator declares the options it reads (:class:`AllocatorOption`, e.g. SUR's
``aggregation``); their values come from ``AllocationRequest.options`` or from a *variant name*
``"Base[option=value,...]"`` (``"SUR[aggregation=mean,partial_unit=prefix]"``), which runs the one registered
allocator with those options bound: a variant is never a copy. ``allowance_base`` may be bound in any variant name (it
sets the request's budget convention). :func:`register_variant` gives a variant its own name (``"SUR-IDF"`` is
``"SUR[bonus=idf]"``); :func:`variant_name` spells a variant canonically.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sur_lab.budget import (
    ALLOWANCE_BASES,
    Selection,
    Support,
    base_allowance,
    check_allowance,
    check_budget,
    fractions_expected,
    warn_if_fraction,
)
from sur_lab.checks import as_count
from sur_lab.edits import EditedContext
from sur_lab.models import LoadedModel
from sur_lab.units import Unit, segment_units


@dataclass
class AllocationRequest:
    """What every allocator receives.

    Attributes:
        lm: the model (its frozen embeddings, forwards for attention-derived signals).
        edit: the edit (edited tokens, suffix range ``edit.suffix_slice``, query, text).
        budget_pct: b in [0, 100], percent of the suffix (of the whole edited prompt with ``allowance_base="prompt"``);
            ``None`` when ``allowance`` is given alone. With both, ``allowance`` decides B and ``budget_pct`` is the
            nominal budget a record may carry.
        shift_cache: the Shift cache of ``p ⊕ s`` (``DynamicCache``), shared by all methods of a case; read-only.
        units: semantic units of the suffix; computed on first use and cached on the request.
        seed: case-fixed seed for randomized allocators.
        options: allocator options by name (e.g. SUR's ``"aggregation"``, an auxiliary model); each allocator reads the
            keys it declares (:func:`read_options`) and ignores the others.
        allowance: B, suffix positions to select. Give it (an integer in ``[0, S]``) for an exact per-case count, e.g.
            the matched-token protocol (:func:`sur_lab.allocators.matched.matched_token_selections`); left ``None``
            it is resolved from ``budget_pct`` at construction. After construction it always holds B.
        allowance_base: ``"suffix"`` (Eq. 3: ``B = min(S, ⌈S·b/100⌉)``) or ``"prompt"`` (appendix 9.3's whole-prompt
            allowance: ``B = min(S, ⌈(p + S)·b/100⌉)``, :func:`sur_lab.budget.prompt_allowance`). Applies to
            ``budget_pct`` only; an exact ``allowance`` is used as given.

    ``dataclasses.replace`` keeps the resolved B (passed on as an exact ``allowance``); to change the budget build a
    new request (or :meth:`with_allowance`).

    Raises:
        ValueError: (at construction) naming ``budget_pct`` when it is outside [0, 100]; naming ``allowance`` when it is
            outside ``[0, S]``; naming ``allowance_base`` when it is not one of :data:`sur_lab.budget.ALLOWANCE_BASES`;
            naming both ``budget_pct`` and ``allowance`` when neither is given; when ``seed`` is negative.
        TypeError: (at construction) naming ``allowance`` when it is not an integer.
        TypeError: (at construction) if ``seed`` is not an integer (``1.5`` is not rounded).

    Warns:
        BudgetFractionWarning: (a ``UserWarning``, at construction) when 0 < ``budget_pct`` < 1, usually a fraction
            meant as a percentage (:func:`sur_lab.budget.warn_if_fraction`).
    """

    lm: LoadedModel
    edit: EditedContext
    budget_pct: float | None = None
    shift_cache: Any = None
    units: list[Unit] | None = None
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    allowance: int | None = None
    allowance_base: str = "suffix"

    def __post_init__(self) -> None:
        self.seed = as_count(self.seed, "seed", minimum=0)  # numpy generators take non-negative integer seeds
        if self.budget_pct is None and self.allowance is None:
            raise ValueError(
                "give budget_pct (percent of the suffix, [0, 100]) or allowance (suffix positions, [0, S]); got neither"
            )
        if self.allowance_base not in ALLOWANCE_BASES:
            raise ValueError(f"allowance_base must be one of {ALLOWANCE_BASES}; got {self.allowance_base!r}")
        if self.budget_pct is not None:
            self.budget_pct = check_budget(self.budget_pct)
            warn_if_fraction(self.budget_pct)
        S = self.edit.suffix_len
        #: The allowance as given (``None``: from the budget), kept so that :meth:`with_options` can rebuild B.
        self._given_allowance = None if self.allowance is None else check_allowance(self.allowance, S)
        if self._given_allowance is not None:
            self.allowance = self._given_allowance
        else:
            self.allowance = base_allowance(S, self.edit.edited_len, self.budget_pct, self.allowance_base)

    @property
    def suffix_len(self) -> int:
        """S, tokens."""
        return self.edit.suffix_len

    def get_units(self) -> list[Unit]:
        """The suffix's semantic units (appendix 7.3), computed once per request."""
        if self.units is None:
            self.units = segment_units(self.edit)
        return self.units

    def with_options(self, options: Mapping[str, Any]) -> "AllocationRequest":
        """A new request with ``options`` merged over this one's (theirs win); ``"allowance_base"`` among them sets
        the budget convention (B is re-resolved unless the allowance was given exactly). Units are shared.

        Raises:
            ValueError: naming ``allowance_base`` for a value outside :data:`sur_lab.budget.ALLOWANCE_BASES`.
        """
        opts = dict(options)
        base = opts.pop("allowance_base", self.allowance_base)
        with fractions_expected():  # this request already warned about its budget
            return AllocationRequest(
                self.lm, self.edit, self.budget_pct, shift_cache=self.shift_cache, units=self.units, seed=self.seed,
                options={**self.options, **opts}, allowance=self._given_allowance, allowance_base=base,
            )

    def with_allowance(self, count: int) -> "AllocationRequest":
        """A new request for exactly ``count`` positions (the matched-token protocol), everything else equal.

        Raises:
            ValueError / TypeError: naming ``allowance``, as at construction.
        """
        with fractions_expected():
            return replace(self, allowance=count)


#: An allocator: ``fn(request) -> Selection`` (:class:`sur_lab.budget.Selection`, the allocators' return type, which
#: this package re-exports) with exactly ``request.allowance`` positions.
Allocator = Callable[[AllocationRequest], Selection]


# ---------------------------------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class AllocatorOption:
    """One option an allocator reads from ``AllocationRequest.options`` or from a variant name.

    Attributes:
        name: the key (``"aggregation"``).
        default: the value when the option is absent (the paper's setting).
        choices: the allowed values, when they are a fixed set of strings (the first is not necessarily the default).
        parse: for other options, ``parse(value) -> value``: accepts the value or its text from a variant name and
            raises ``ValueError`` naming the option and the allowed range.
        doc: one line, with the source.
    """

    name: str
    default: Any
    choices: tuple[str, ...] | None = None
    parse: Callable[[Any], Any] | None = None
    doc: str = ""

    def check(self, value: Any) -> Any:
        """``value`` validated (and parsed from text when it came from a variant name).

        Raises:
            ValueError: naming the option and its allowed values.
        """
        if self.choices is not None:
            if not isinstance(value, str) or value not in self.choices:
                raise ValueError(f"option {self.name}={value!r}; allowed: {', '.join(self.choices)}")
            return value
        return self.parse(value) if self.parse is not None else value


#: Request-level options every allocator accepts (they set how B is resolved, not how positions are chosen).
REQUEST_OPTIONS: dict[str, AllocatorOption] = {
    "allowance_base": AllocatorOption(
        "allowance_base", "suffix", ALLOWANCE_BASES,
        doc="budget b as a percentage of the suffix (Eq. 3) or of the whole edited prompt (appendix 9.3)",
    ),
}


class AllocatorRegistry(dict):
    """Registered allocators by name (``dict[str, Allocator]``); iteration and ``sorted()`` give registered names.

    ``name in ALLOCATORS`` and ``ALLOCATORS[name]`` also accept a valid variant spelling ``"Base[option=value,...]"``
    (resolved by :func:`resolve_method`; the result runs the base allocator with the options bound), so dispatchers
    that check membership accept variant names without knowing about them.
    """

    def __contains__(self, name: object) -> bool:
        if dict.__contains__(self, name):
            return True
        try:
            resolve_method(name)  # type: ignore[arg-type]
        except (KeyError, ValueError, TypeError):
            return False
        return True

    def __missing__(self, name: str) -> Allocator:
        base, bound = resolve_method(name)
        return _bind(base, bound, name)


ALLOCATORS: AllocatorRegistry = AllocatorRegistry()
#: Options each registered allocator declares, by allocator name (variants: their base's, minus the bound ones).
ALLOCATOR_OPTIONS: dict[str, dict[str, AllocatorOption]] = {}
#: Named variants: name → (base allocator name, bound options).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {}

_VARIANT = re.compile(r"^(?P<base>[^\[\]]+?)\s*\[(?P<opts>[^\[\]]*)\]$")


def register_allocator(name: str, *, options: tuple[AllocatorOption, ...] = ()) -> Callable[[Allocator], Allocator]:
    """Decorator registering an allocator under ``name`` (the paper's name) with the options it reads.

    Raises:
        ValueError: re-registering a name with another function, or a name with brackets (reserved for variants).
    """
    if "[" in name or "]" in name:
        raise ValueError(f"allocator name={name!r} must not contain brackets (reserved for variant names)")

    def wrap(fn: Allocator) -> Allocator:
        if dict.__contains__(ALLOCATORS, name) and dict.__getitem__(ALLOCATORS, name) is not fn:
            raise ValueError(f"allocator {name!r} is already registered")
        ALLOCATORS[name] = fn
        ALLOCATOR_OPTIONS[name] = {o.name: o for o in options}
        return fn

    return wrap


def register_variant(name: str, base: str, **bound: Any) -> Allocator:
    """Register ``name`` as allocator ``base`` with ``bound`` options (a named variant, not a copy).

    ``allocate(name, request)`` runs ``base``'s function on ``request.with_options(bound)``.

    Raises:
        ValueError: for an unknown ``base``, an option ``base`` does not declare, a bad value, or a taken name.
    """
    if dict.__contains__(ALLOCATORS, name):
        raise ValueError(f"allocator {name!r} is already registered")
    if "[" in name or "]" in name:
        raise ValueError(f"allocator name={name!r} must not contain brackets (reserved for variant names)")
    base_name, fixed = resolve_method(base)
    declared = ALLOCATOR_OPTIONS.get(base_name, {})
    checked = dict(fixed)
    for key, value in bound.items():
        spec = declared.get(key) or REQUEST_OPTIONS.get(key)
        if spec is None:
            raise ValueError(f"allocator {base_name!r} has no option {key!r}; options: {', '.join(declared)}")
        checked[key] = spec.check(value)
    VARIANTS[name] = (base_name, checked)
    ALLOCATOR_OPTIONS[name] = {k: v for k, v in declared.items() if k not in checked}
    fn = _bind(base_name, checked, name)
    ALLOCATORS[name] = fn
    return fn


def _bind(base: str, bound: dict[str, Any], name: str) -> Allocator:
    fn = dict.__getitem__(ALLOCATORS, base)
    if not bound:
        return fn

    def run(request: AllocationRequest) -> Selection:
        return fn(request.with_options(bound))

    run.__name__ = run.__qualname__ = f"variant({name})"
    run.__doc__ = f"{base} with {bound} bound (variant {name!r})."
    return run


def resolve_method(name: str) -> tuple[str, dict[str, Any]]:
    """The registered base allocator and the options a method name binds.

    ``"SUR"`` → ``("SUR", {})``; ``"SUR-IDF"`` → ``("SUR", {"bonus": "idf"})``; ``"SUR[aggregation=mean]"`` →
    ``("SUR", {"aggregation": "mean"})``. Inside brackets, ``key=value`` pairs are separated by commas; spaces around
    them are ignored; a key may appear once and may not re-bind an option the named variant already fixes.

    Raises:
        TypeError: if ``name`` is not a string.
        KeyError: for a plain name that is not registered.
        ValueError: naming the allocator, the option or the value for a malformed or invalid variant spelling.
    """
    if not isinstance(name, str):
        raise TypeError(f"allocator name must be a string; got {name!r}")
    if dict.__contains__(ALLOCATORS, name):
        base, bound = VARIANTS.get(name, (name, {}))
        return base, dict(bound)
    m = _VARIANT.match(name.strip())
    if m is None:
        if "[" in name or "]" in name:
            raise ValueError(f"malformed variant name={name!r}; expected 'Allocator[option=value,...]'")
        raise KeyError(name)
    outer = m["base"].strip()
    if not dict.__contains__(ALLOCATORS, outer):
        registered = ", ".join(sorted(ALLOCATORS))
        raise ValueError(f"unknown allocator {outer!r} in variant name={name!r}; registered: {registered}")
    base, bound = resolve_method(outer)
    declared = ALLOCATOR_OPTIONS.get(outer, {})
    seen: set[str] = set()
    for pair in filter(None, (p.strip() for p in m["opts"].split(","))):
        key, sep, value = (s.strip() for s in pair.partition("="))
        if not sep or not key:
            raise ValueError(f"variant name={name!r}: {pair!r} is not option=value")
        if key in seen:
            raise ValueError(f"variant name={name!r} gives option {key!r} twice")
        seen.add(key)
        if key in bound and key not in declared:
            raise ValueError(f"variant name={name!r}: option {key!r} is fixed by {outer!r} ({key}={bound[key]!r})")
        spec = declared.get(key) or REQUEST_OPTIONS.get(key)
        if spec is None:
            allowed = ", ".join([*declared, *REQUEST_OPTIONS])
            raise ValueError(f"variant name={name!r}: allocator {outer!r} has no option {key!r}; options: {allowed}")
        bound[key] = spec.check(value)
    return base, bound


def variant_name(base: str, **options: Any) -> str:
    """The canonical method name of allocator ``base`` with ``options`` bound.

    Options equal to their defaults are dropped, the rest are written in the allocator's declared order (request-level
    options last) as ``Base[key=value,...]``; a combination that a registered variant binds exactly returns that
    variant's name (``variant_name("SUR", bonus="idf") == "SUR-IDF"``).

    Raises:
        ValueError: for an unknown allocator, option or value (as :func:`resolve_method`).
    """
    base_name, bound = resolve_method(base)
    declared = ALLOCATOR_OPTIONS.get(base_name, {})
    for key, value in options.items():
        spec = declared.get(key) or REQUEST_OPTIONS.get(key)
        if spec is None:
            raise ValueError(f"allocator {base_name!r} has no option {key!r}; options: {', '.join(declared)}")
        bound[key] = spec.check(value)
    specs = {**declared, **REQUEST_OPTIONS}
    bound = {k: v for k, v in bound.items() if v != specs[k].default}
    for name, (vbase, vbound) in VARIANTS.items():
        if vbase == base_name and vbound == bound:
            return name
    if not bound:
        return base_name
    order = [k for k in specs if k in bound]
    return f"{base_name}[{','.join(f'{k}={bound[k]}' for k in order)}]"


def read_options(request: AllocationRequest, name: str) -> dict[str, Any]:
    """The options allocator ``name`` declares, from ``request.options`` (validated) or their defaults.

    Raises:
        ValueError: naming the option and its allowed values when ``request.options`` holds a bad value.
    """
    return {
        key: spec.check(request.options[key]) if key in request.options else spec.default
        for key, spec in ALLOCATOR_OPTIONS.get(name, {}).items()
    }


def get_allocator(name: str) -> Allocator:
    """Look up an allocator by name or variant name (``"SUR[aggregation=mean]"``).

    Raises:
        ValueError: naming ``name`` and listing the registered allocators; or naming the bad option or value of a
            variant name.
    """
    if not isinstance(name, str):
        raise ValueError(f"allocator name must be a string; got {type(name).__name__} {name!r}; registered: "
                         f"{', '.join(sorted(ALLOCATORS))}")
    try:
        return ALLOCATORS[name]
    except KeyError:
        raise ValueError(f"unknown allocator name={name!r}; registered: {', '.join(sorted(ALLOCATORS))}") from None


def allowance_for(name: str, request: AllocationRequest, *, selectable: int | None = None) -> int:
    """B that ``allocate(name, request)`` will select: ``request.allowance``, re-resolved when the method name binds
    ``allowance_base`` (``"SUR[allowance_base=prompt]"``). For dispatchers that apply Algorithm 1's B = 0 / B = S
    endpoints and record B before allocating (:func:`sur_lab.repair.repair`).

    Args:
        name: a registered allocator or variant name.
        request: the request (its budget, exact allowance and allowance base).
        selectable: the suffix positions B is a share of, when some of the S are recomputed whatever the allocator
            picks (an edit session's inserted rows inside the suffix, ``repair(..., forced=...)``): Eq. 3 over
            ``selectable`` positions (``min(selectable, ⌈N⁻·b/100⌉)`` on the whole-prompt base, N⁻ the edited
            prompt's tokens). ``None``: all S. An exact ``allowance`` given to the request is used as given.

    Raises:
        ValueError: for an unknown allocator name or a bad variant option; naming ``selectable`` outside ``[0, S]``.
    """
    get_allocator(name)
    _, bound = resolve_method(name)
    if selectable is not None:
        S = request.suffix_len
        if isinstance(selectable, (bool, np.bool_)) or not isinstance(selectable, (int, np.integer)) or not (
            0 <= selectable <= S
        ):
            raise ValueError(f"selectable must be an integer in [0, S={S}]; got {selectable!r}")
        if request._given_allowance is None:
            base = bound.get("allowance_base", request.allowance_base)
            return base_allowance(int(selectable), request.edit.edited_len, request.budget_pct, base)
        return request.allowance
    if "allowance_base" not in bound:
        return request.allowance
    return request.with_options({"allowance_base": bound["allowance_base"]}).allowance


def allocate(name: str, request: AllocationRequest) -> Selection:
    """Run allocator ``name`` (a registered name or a variant name) on ``request``, time it, and check that it
    returned exactly B positions (Eq. 3, or the exact ``allowance``).

    A name that binds options runs the base allocator on ``request.with_options(bound)``; B is then that request's
    (an ``allowance_base`` binding changes it). Units computed on the way are kept on ``request``.

    Raises:
        ValueError: for an unknown allocator name or a bad variant option (before any work).
        RuntimeError: if the allocator broke the exact-allowance contract.
    """
    get_allocator(name)  # the error names the registered allocators
    base, bound = resolve_method(name)
    fn = dict.__getitem__(ALLOCATORS, base)
    call = request.with_options(bound) if bound else request
    t0 = time.perf_counter()
    selection = fn(call)
    ms = (time.perf_counter() - t0) * 1e3
    if request.units is None and call.units is not None:
        request.units = call.units
    if selection.support.size != call.allowance or selection.support.suffix_len != call.suffix_len:
        raise RuntimeError(
            f"allocator {name!r} returned {selection.support.size} positions; the allowance is {call.allowance}"
        )
    return replace(selection, select_ms=ms)


def top_b(scores: np.ndarray, b: int) -> np.ndarray:
    """Indices of the ``b`` highest scores, earlier index first among ties, returned sorted by position."""
    order = np.lexsort((np.arange(len(scores)), -np.asarray(scores, dtype=np.float64)))
    return np.sort(order[:b])


def empty_selection(suffix_len: int, **diagnostics: Any) -> Selection:
    """The B = 0 selection (no position) of a suffix of ``suffix_len`` tokens."""
    return Selection(Support(np.zeros(0, dtype=np.int64), suffix_len), diagnostics=dict(diagnostics))
