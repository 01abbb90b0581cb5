"""MkDocs hooks (``hooks:`` in mkdocs.yml): the notebook pages and the generated results page.

* Notebook pages come from ``$SUR_LAB_DOCS_RUN`` when it is set (a folder of executed copies, as ``make docs`` writes
  with ``python -m sur_lab.runtime.run_notebooks --smoke --outputs ...``), else from ``notebooks/`` (committed, without
  outputs, as the CI test builds them). A notebook without an executed copy in the run folder is shown as committed.
  Widget outputs (tqdm progress bars, the token view's control) have no state in an executed copy: their
  widget-view data is dropped so that the static fallback (text or HTML) renders.
* ``results.md`` is generated at build time from the same folder's records by
  :mod:`sur_lab.runtime.results_page` (with the default suite's copies in ``outputs/`` when there are any; the
  release's times are on its own pages, with each run's machine from its manifest); it is never typed by hand.
* The *Results* section (``release/``) renders the committed release, ``results/`` (or ``$SUR_LAB_DOCS_RESULTS``):
  the claims table, each notebook's figures and tables, and the run manifest, with a banner on every result whose
  fingerprint differs from the current code (:func:`sur_lab.runtime.results_page.release_pages`).
* Every built page is checked for a literal triple backtick outside code (:func:`unrendered_fences`): a fence whose
  info string pymdownx.superfences does not accept (``python test="slow"``) is left as a paragraph, which
  ``mkdocs build --strict`` would not notice; the check's warning fails the strict build.
* The API reference has one generated page per package (``api/<package>.md``: the core modules of ``sur_lab/``, then
  each subpackage), found by walking ``sur_lab/``, so a module added, moved or renamed is documented (and its
  docstrings' cross-references checked) without editing the navigation; the *Studies* section lists every page
  under ``docs/studies/`` the same way. Any other page must be in ``nav`` (``validation.omitted_files: warn`` makes
  a page left out of it fail the strict build).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
from pathlib import Path

import mkdocs.plugins
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "sur_lab"
NOTEBOOKS = REPO / "notebooks"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
LOG = mkdocs.plugins.get_plugin_logger("sur_lab_docs")
#: Elements whose text is code: a triple backtick inside them is content, not a fence left unrendered.
_CODE_ELEMENTS = re.compile(r"<(pre|code|script|textarea)\b.*?</\1>", re.S | re.I)


def unrendered_fences(html: str) -> list[str]:
    """Each literal triple backtick of a built page outside ``<pre>``, ``<code>``, ``<script>`` and ``<textarea>``,
    with the text after it (what the unrendered fence's info string was)."""
    text = _CODE_ELEMENTS.sub("", html)
    return [text[m.start(): m.start() + 40].split("\n")[0] for m in re.finditer("```", text)]


def on_post_page(output: str, page, config) -> str:
    """Warn (an error under ``--strict``) about a fence the Markdown extensions left unrendered."""
    for found in unrendered_fences(output):
        LOG.warning(f"{page.file.src_path}: a code fence was not rendered (literal {found!r} in the built page); "
                    "use a plain language info string and put options such as the test marker in an HTML comment")
    return output


def results_folder() -> Path:
    """The release folder the Results section renders: ``$SUR_LAB_DOCS_RESULTS`` when set, else ``results/``."""
    value = os.environ.get("SUR_LAB_DOCS_RESULTS")
    return Path(value).resolve() if value else REPO / "results"


def run_folder() -> Path | None:
    """The executed-notebook folder named by ``$SUR_LAB_DOCS_RUN`` (None when unset)."""
    value = os.environ.get("SUR_LAB_DOCS_RUN")
    if not value:
        return None
    folder = Path(value).resolve()
    if not folder.is_dir():
        raise FileNotFoundError(f"SUR_LAB_DOCS_RUN={value!r} is not a folder of executed notebooks")
    return folder


def _static_outputs(nb: dict) -> dict:
    """Drop widget-view data wherever the output carries a static fallback (the widgets have no saved state)."""
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data and WIDGET_VIEW in data and len(data) > 1:
                del data[WIDGET_VIEW]
    return nb


def stage_notebooks(run: Path | None, stage: Path) -> list[Path]:
    """Copy each notebook's page source (executed copy or committed notebook) into ``stage/notebooks/``."""
    target = stage / "notebooks"
    shutil.rmtree(stage, ignore_errors=True)
    target.mkdir(parents=True)
    staged = []
    for source in sorted(NOTEBOOKS.glob("*.ipynb")):
        executed = run / source.name if run is not None else None
        path = executed if executed is not None and executed.is_file() else source
        nb = _static_outputs(json.loads(path.read_text(encoding="utf-8")))
        out = target / source.name
        out.write_text(json.dumps(nb, ensure_ascii=False), encoding="utf-8")
        staged.append(out)
    return staged


@mkdocs.plugins.event_priority(100)  # before mkdocs-jupyter wraps the .ipynb files
def on_files(files, config):
    from sur_lab.paths import outputs_dir
    from sur_lab.runtime.results_page import release_pages, results_markdown

    run = run_folder()
    stage = Path(config["site_dir"]).resolve().parent / "docs-notebooks"  # beside the site: build/docs-notebooks
    for path in stage_notebooks(run, stage):
        src = f"notebooks/{path.name}"
        existing = files.get_file_from_path(src)
        if existing is not None:
            files.remove(existing)
        files.append(File(src, str(stage), config["site_dir"], config["use_directory_urls"]))
    results = results_folder()
    # The release's runs are on its own pages, with the machine of each from its manifest; this page shows the
    # build's run and the local outputs/ (the notebook stamps do not say which CPU ran them).
    files.append(File.generated(config, "results.md", content=results_markdown(run, outputs_dir())))
    pages, assets = release_pages(results, notebook_titles(config["nav"]))
    for name, content in pages.items():
        files.append(File.generated(config, name, content=content))
    for name, path in assets.items():
        files.append(File.generated(config, name, abs_src_path=str(path)))
    for name, content in api_pages().items():
        files.append(File.generated(config, name, content=content))
    return files


def notebook_titles(nav) -> dict[str, str]:
    """Notebook stem -> its title in the navigation's Notebooks section (``"03 Natural QA and latency"``)."""
    titles = {}
    for item in nav or []:
        if isinstance(item, dict):
            (title, value), = item.items()
            if isinstance(value, list):
                titles.update(notebook_titles(value))
            elif isinstance(value, str) and value.startswith("notebooks/") and value.endswith(".ipynb"):
                titles[Path(value).stem] = title
    return titles


def api_pages() -> dict[str, str]:
    """``{"api/<name>.md": markdown}``: ``core`` (the modules directly under ``sur_lab/``), then one page per
    subpackage with the package docstring and every public module below it (names starting with ``_`` are private)."""

    def modules(folder: Path) -> list[str]:
        found = []
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            if any(part.startswith("_") for part in rel.parts if part != "__init__") or "__pycache__" in rel.parts:
                continue
            found.append(".".join(rel.parts).removesuffix(".__init__"))
        return found

    def own_names(module: str) -> list[str]:
        """Public names a package's ``__init__.py`` defines itself (functions, classes, assignments; no imports)."""
        tree = ast.parse((REPO / Path(*module.split(".")) / "__init__.py").read_text(encoding="utf-8"))
        names = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names += [t.id for t in targets if isinstance(t, ast.Name)]
        return [n for n in dict.fromkeys(names) if not n.startswith("_") and n != "__all__"]

    def block(module: str, package_doc: bool = False) -> str:
        # a package's page shows its docstring and what its __init__ defines (e.g. sur_lab.studies.STUDIES), not
        # the names it re-exports (documented where they are defined) nor its submodules (their own blocks)
        options = (f"\n    options:\n      members: {json.dumps(own_names(module)) if module != 'sur_lab' else 'false'}"
                   "\n      show_root_heading: true") if package_doc else ""
        return f"::: {module}{options}\n"

    top = sorted(p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_"))
    pages = {"api/core.md": "# sur_lab (core)\n\nThe public API (`import sur_lab`) and the core operators.\n\n"
             + block("sur_lab", package_doc=True) + "\n".join(block(f"sur_lab.{m}") for m in top)}
    for sub in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() and not p.name.startswith("_")):
        names = modules(sub)
        sub_packages = [m for m in names[1:] if (REPO / Path(*m.split("."), "__init__.py")).is_file()]
        body = [block(names[0], package_doc=True)] + [block(m, package_doc=m in sub_packages) for m in names[1:]]
        pages[f"api/{sub.name}.md"] = f"# sur_lab.{sub.name}\n\n" + "\n".join(body)
    return pages


@mkdocs.plugins.event_priority(100)
def on_config(config):
    """Replace the navigation's ``API`` entry with the generated per-package pages, its ``Studies`` entry with
    every page under ``docs/studies/`` (one per study, added by the studies' authors), index first, and its
    ``Results`` entry with the release's pages (the claims and runs, then one page per notebook)."""
    from sur_lab.runtime.results_page import SITE_PREFIX

    pages = api_pages()
    titles = notebook_titles(config["nav"])
    # "(results)": the Notebooks section lists the same titles for the notebooks themselves.
    release = [f"{SITE_PREFIX}/index.md"] + [{f"{titles.get(p.stem, p.stem)} (results)": f"{SITE_PREFIX}/{p.stem}.md"}
                                            for p in sorted(NOTEBOOKS.glob("*.ipynb"))]
    studies = sorted(str(p.relative_to(REPO / "docs")) for p in (REPO / "docs" / "studies").glob("*.md"))
    studies = ["studies/index.md"] + [p for p in studies if p != "studies/index.md"]

    def patch(items):
        for i, item in enumerate(items):
            if isinstance(item, dict):
                (title, value), = item.items()
                if title == "API":
                    items[i] = {"API": ["api/index.md"] + list(pages)}
                elif title == "Studies":
                    items[i] = {"Studies": studies}
                elif title == "Results":
                    items[i] = {"Results": release}
                elif isinstance(value, list):
                    patch(value)

    patch(config["nav"])
    return config
