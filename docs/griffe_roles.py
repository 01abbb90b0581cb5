"""Griffe extension (mkdocs.yml, mkdocstrings options): Sphinx roles in sur_lab's docstrings become checked links.

The docstrings cross-reference with Sphinx roles (``:func:`load_model```, ``:class:`~sur_lab.budget.Support```).
Each role is resolved the way Python would resolve the name in the docstring's scope (the object, its parents, the
module's imports) to the documented object's canonical path and written as an autorefs link. A target inside
``sur_lab`` that does not resolve stays an autorefs link to its literal name, so ``mkdocs build --strict`` fails on it
("Could not find cross-reference target"): a renamed or deleted object cannot leave a dangling reference behind.
Targets outside ``sur_lab`` (torch, transformers, the standard library) are shown as code, unlinked.

Module constants are documented with Sphinx's ``#:`` comments above them; griffe reads only string docstrings, so the
comment block becomes the attribute's docstring here (and the constant gets an API entry that references can reach).
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const)?:`(~?)([^`<>]+?)`")
PACKAGE = "sur_lab"


def _lookup(collection, path: str):
    try:
        return collection[path]
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _canonical(obj) -> str | None:
    """The path where ``obj`` is documented (an import alias's final target), or None when it lies outside."""
    try:
        target = obj.final_target if obj.is_alias else obj
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    return target.path


def resolve(name: str, scope, collection) -> str | None:
    """Canonical path of ``name`` as seen from ``scope`` (an object), or None."""
    name = name.strip().lstrip(".").removesuffix("()")
    if name.split(".")[0] == PACKAGE:
        found = _lookup(collection, name)
        return _canonical(found) if found is not None else None
    head, _, rest = name.partition(".")
    node = scope
    while node is not None:
        member = node.members.get(head) if hasattr(node, "members") else None
        if member is not None:
            if not rest:
                return _canonical(member)
            base = _canonical(member)
            found = _lookup(collection, f"{base}.{rest}") if base else None
            return _canonical(found) if found is not None else None
        node = node.parent
    return None


def rewrite(text: str, scope, collection) -> str:
    def link(match: re.Match) -> str:
        short, name = match.group(1) == "~", match.group(2).strip()
        shown = name.split(".")[-1] if short else name
        path = resolve(name, scope, collection)
        if path is None:
            internal = name.split(".")[0] == PACKAGE or not _external(name, scope)
            return f"[`{shown}`][{name}]" if internal else f"`{shown}`"
        if not path.startswith(PACKAGE + ".") and path != PACKAGE or _private(path):
            return f"`{shown}`"  # outside the package, or a private helper the API pages do not show
        return f"[`{shown}`][{path}]"

    return ROLE.sub(link, text)


def _private(path: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in path.split("."))


def _external(name: str, scope) -> bool:
    """Whether ``name``'s first part is imported into the module from outside sur_lab (or is a dotted external path)."""
    head = name.split(".")[0]
    module = scope.module if hasattr(scope, "module") else scope
    member = module.members.get(head)
    if member is not None and member.is_alias:
        return not member.target_path.startswith(PACKAGE)
    return "." in name  # e.g. torch.nn.Module or papermill.execute_notebook, not imported by name


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of the package once the whole tree is loaded (aliases resolve then)."""

    def on_package(self, *, pkg, loader, **kwargs) -> None:
        collection = loader.modules_collection
        stack = [pkg]
        while stack:
            obj = stack.pop()
            if obj.is_attribute and obj.docstring is None:
                comment = _comment_docstring(obj)
                if comment:
                    obj.docstring = griffe.Docstring(comment, lineno=obj.lineno, parent=obj)
            if obj.docstring is not None and ":`" in obj.docstring.value:
                obj.docstring.value = rewrite(obj.docstring.value, obj, collection)
            stack.extend(m for m in obj.members.values() if not m.is_alias)


def _comment_docstring(attr) -> str:
    """The ``#:`` comment block right above an attribute's assignment, without the markers ("" when there is none)."""
    try:
        lines = attr.module.lines
    except Exception:  # noqa: BLE001 - a module without source (compiled): nothing to read
        return ""
    i = (attr.lineno or 0) - 2
    block = []
    while i >= 0 and lines[i].lstrip().startswith("#:"):
        block.append(lines[i].lstrip()[2:].strip())
        i -= 1
    return " ".join(reversed(block))
