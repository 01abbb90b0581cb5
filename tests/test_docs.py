"""The README is a front page whose code runs, and the documentation site builds with ``mkdocs build --strict``.

- Every ``python`` block of README.md runs (in a fresh interpreter, from an empty folder), and so does every block of
  ``docs/*.md`` marked ``<!-- test: fast -->`` or ``<!-- test: slow -->`` on the line before its fence (slow: it loads
  an embedded model). The marker is an HTML comment, not an option in the info string: GitHub and
  pymdownx.superfences both render a plain ``python`` fence, and superfences renders an info string it does not know
  as a paragraph.
- The site builds from the committed notebooks (no outputs) in strict mode, so a broken link, an unknown page in the
  navigation or a docstring cross-reference that does not resolve fails this test (the Sphinx roles in docstrings are
  turned into checked links by ``docs/griffe_roles.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
#: A python fence and the test marker on the line before it (``<!-- test: slow -->``).
FENCE = re.compile(r"^(?:<!--\s*test:\s*(\w+)\s*-->\n)?```python([^\n]*)\n(.*?)^```", re.M | re.S)
#: Any fence's opening line (at any indentation) and its info string.
FENCE_OPEN = re.compile(r"^[ \t]*(?:```|~~~)(.*)$", re.M)
#: Typed timings (a number with a time unit) and dates: a front page quotes neither (measured times are generated).
TIMING = re.compile(r"\d[\d.,]*\s?(?:ms|s|sec|seconds?|min|minutes?|h|hours?)\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def code_blocks(path: Path, *, all_blocks: bool) -> list[tuple[str, str, str]]:
    """``(id, mode, code)`` of the python blocks to run: ``mode`` is "fast", "slow" or "skip" (from a
    ``<!-- test: MODE -->`` line before the fence); without a marker a block runs (as slow) only when ``all_blocks``.

    Raises:
        ValueError: naming the page and block when the mode is not fast, slow or skip, or the fence's info string
            holds more than the language (``python test="slow"``: superfences would not render it as code).
    """
    out = []
    for i, m in enumerate(FENCE.finditer(path.read_text(encoding="utf-8"))):
        if m.group(2).strip():
            raise ValueError(f"{path.name} block {i}: info string 'python{m.group(2)}': put the test marker in a "
                             "'<!-- test: slow -->' line before the fence")
        mode = m.group(1) or ("slow" if all_blocks else "skip")
        if mode not in ("fast", "slow", "skip"):
            raise ValueError(f"{path.name} block {i}: test: {mode!r} must be fast, slow or skip")
        if mode != "skip":
            out.append((f"{path.stem}-{i}", mode, m.group(3)))
    return out


BLOCKS = code_blocks(README, all_blocks=True) + [
    b for page in sorted(DOCS.rglob("*.md")) for b in code_blocks(page, all_blocks=False)]


PAGES = [README] + sorted(DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_fence_info_strings_are_plain_languages(page):
    """A fence's info string is one language word (or none), which GitHub and pymdownx.superfences both highlight;
    anything after it (``python test="slow"``) makes superfences leave the block as a paragraph."""
    bad = [m.group(0).strip() for m in FENCE_OPEN.finditer(page.read_text(encoding="utf-8"))
           if not re.fullmatch(r"[A-Za-z0-9_+-]*", m.group(1).strip())]
    assert not bad, f"{page.name}: fences whose info string is more than a language: {bad}"


def test_unrendered_fences_are_found(caplog):
    sys.path.insert(0, str(DOCS))
    try:
        import hooks
    finally:
        sys.path.remove(str(DOCS))
    good = '<div class="highlight"><pre><span></span><code>```python\nx = 1\n```</code></pre></div><p>`a`</p>'
    assert hooks.unrendered_fences(good) == []
    bad = '<p>```python test="slow"\nimport torch</p><h1>comment</h1><p>```</p>'
    assert hooks.unrendered_fences(bad) == ['```python test="slow"', "```</p>"]

    class Page:
        class file:
            src_path = "agents.md"

    with caplog.at_level("WARNING"):
        assert hooks.on_post_page(bad, Page, {}) == bad
    assert "agents.md: a code fence was not rendered" in caplog.text


def test_code_block_markers(tmp_path):
    md = tmp_path / "page.md"
    md.write_text("<!-- test: fast -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n")
    assert code_blocks(md, all_blocks=False) == [("page-0", "fast", "x = 1\n")]
    assert [b[1] for b in code_blocks(md, all_blocks=True)] == ["fast", "slow"]
    md.write_text('```python test="slow"\nx = 1\n```\n')
    with pytest.raises(ValueError, match="info string"):
        code_blocks(md, all_blocks=True)


def test_readme_is_a_front_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150, "README.md is a front page: move details to docs/"
    assert "/work/" not in text and not re.search(r"(?<![\w.])/(?:home|root|tmp|Users)/", text), "absolute machine path"
    assert not DATE.search(text), "dated measurement in README.md"
    assert not TIMING.findall(text), f"typed timings in README.md: {TIMING.findall(text)}"
    assert "make test" in (REPO / ".ci" / "run").read_text(), ".ci/run must call the README's test command"
    for link in re.findall(r"\]\(((?:docs/|ARCHITECTURE)[^)#]*)", text):
        assert (REPO / link).is_file(), f"README links to a missing file: {link}"
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (REPO / image).is_file() and (REPO / image).stat().st_size < 300_000, f"README image {image}"
    assert BLOCKS and any(b[0].startswith("README") for b in BLOCKS), "README.md has no python example to run"


@pytest.mark.parametrize("block_id, mode, code", [
    pytest.param(*b, marks=[pytest.mark.slow] if b[1] == "slow" else []) for b in BLOCKS], ids=[b[0] for b in BLOCKS])
def test_code_block_runs(block_id, mode, code, tmp_path):
    from sur_lab.paths import default_data_dir

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "SUR_LAB_OUTPUTS_DIR": str(tmp_path / "outputs")}
    try:  # the block runs from an empty folder: hand it the data folder this checkout finds
        env.setdefault("SUR_LAB_DATA_DIR", str(default_data_dir()))
    except FileNotFoundError:
        pass
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, f"{block_id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def test_sphinx_roles_resolve_to_checked_links():
    griffe = pytest.importorskip("griffe")
    sys.path.insert(0, str(DOCS))
    try:
        from griffe_roles import rewrite
    finally:
        sys.path.remove(str(DOCS))
    loader = griffe.GriffeLoader(search_paths=[str(REPO)])
    loader.load("sur_lab")
    loader.resolve_aliases(implicit=False)
    collection = loader.modules_collection
    session = collection["sur_lab.session"]
    assert rewrite(":class:`~sur_lab.budget.Support`", session, collection) == "[`Support`][sur_lab.budget.Support]"
    # a name imported into the module resolves to where it is defined
    assert rewrite(":class:`LoadedModel`", collection["sur_lab.sweeps.case"], collection) == (
        "[`LoadedModel`][sur_lab.models.LoadedModel]")
    # outside the package: shown as code, unlinked; unknown inside: left as a link that fails the strict build
    assert rewrite(":class:`torch.Tensor`", session, collection) == "`torch.Tensor`"
    assert rewrite(":func:`sur_lab.no_such_function`", session, collection) == (
        "[`sur_lab.no_such_function`][sur_lab.no_such_function]")


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocs_jupyter")
    env = {k: v for k, v in os.environ.items() if k != "SUR_LAB_DOCS_RUN"}
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                "SUR_LAB_OUTPUTS_DIR": str(tmp_path / "outputs"), "SUR_LAB_DOCS_CACHE": str(tmp_path / "cache"),
                "NO_MKDOCS_2_WARNING": "1"})
    site = tmp_path / "site"
    # no -q: it silences warnings before strict mode counts them, so a broken reference would pass
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for page in ("index.html", "results/index.html", "notebooks/00_quickstart/index.html", "api/core/index.html",
                 "architecture/index.html", "reproducing/index.html"):
        assert (site / page).is_file(), page
    assert "No executed notebook was found" in (site / "results" / "index.html").read_text() or (
        REPO / "results" / "manifest.json").is_file()  # the measured-times page; the release's copies once committed
    release = (site / "release" / "index.html").read_text()  # the Results section renders results/
    assert "Claims" in release and ">P1<" in release and "Runs" in release
    architecture = (site / "architecture" / "index.html").read_text()
    assert "What each folder owns" in architecture, "ARCHITECTURE.md is included, not copied"


def test_studies_index_lists_its_pages():
    """Every page under docs/studies/ is linked from the Studies index (the navigation lists them from the folder,
    docs/hooks.py; the index says what each is), and the index links no page that is not there."""
    folder = DOCS / "studies"
    pages = {p.name for p in folder.glob("*.md")} - {"index.md"}
    linked = set(re.findall(r"\]\(([\w-]+\.md)\)", (folder / "index.md").read_text(encoding="utf-8")))
    assert pages and pages == linked, f"not linked: {sorted(pages - linked)}; no such page: {sorted(linked - pages)}"


def _listed_notebooks(text: str, pattern: str) -> set[str]:
    return set(re.findall(pattern, text, re.M))


def test_every_notebook_is_listed():
    """A notebook in ``notebooks/`` is listed, one line each, in the README's notebook table, on the notebook-suite
    and reproducing pages, in the site navigation and in ``tests/notebook_outputs.py`` (its smoke run's expected
    outputs); and nothing is listed that is not in ``notebooks/``. Adding a notebook means adding those five lines."""
    import yaml

    from notebook_outputs import EXPECTED, PENDING

    stems = {p.stem for p in (REPO / "notebooks").glob("*.ipynb")}
    row = r"^\| `(\d\d_\w+)` \|"
    readme = README.read_text(encoding="utf-8").split("## Notebooks", 1)[1].split("\n## ", 1)[0]

    class Loader(yaml.SafeLoader):  # mkdocs.yml's !ENV tags: read as plain values
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    nav: list[str] = []

    def walk(items):
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            walk(value) if isinstance(value, list) else nav.append(value)

    walk(yaml.load((REPO / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)["nav"])
    listed = {
        "README.md (## Notebooks table)": _listed_notebooks(readme, row),
        "docs/reproducing.md (## By notebook table)": _listed_notebooks(
            (DOCS / "reproducing.md").read_text(encoding="utf-8"), row),
        "docs/notebooks.md (notebook table)": _listed_notebooks(
            (DOCS / "notebooks.md").read_text(encoding="utf-8"), r"^\| \[`(\d\d_\w+)`\]\(notebooks/\1\.ipynb\) \|"),
        "mkdocs.yml nav": {Path(p).stem for p in nav if p.startswith("notebooks/") and p.endswith(".ipynb")},
        "tests/notebook_outputs.py (EXPECTED or PENDING)": set(EXPECTED) | set(PENDING),
    }
    for where, names in listed.items():
        assert not stems - names, f"{where} does not list {sorted(stems - names)}"
        assert not names - stems, f"{where} lists notebooks that are not in notebooks/: {sorted(names - stems)}"
