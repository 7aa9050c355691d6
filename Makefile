# Naiad: `make serve` and `make test` do all set-up on a fresh machine.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
REPO   ?= examples/model_repository
EXTRAS ?= onnx,torch,operator,test
PYTEST_ARGS ?=

.PHONY: venv serve test test-gpu examples bench e2e lint clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

examples: $(REPO)/.built

$(REPO)/.built: venv examples/build_repository.py $(shell find examples/src -type f 2>/dev/null)
	$(PY) examples/build_repository.py --out $(REPO)
	touch $@

serve: venv examples
	$(VENV)/bin/naiad serve --model-repository $(REPO) --http-port 8000 --grpc-port 8001 --metrics-port 8002

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

test-gpu: venv
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS) tests

lint: venv
	$(PY) -m ruff check server operator tests || true

clean:
	rm -rf $(VENV) $(REPO) .pytest_cache
