# Naiad: `make serve` and `make test` do all set-up on a fresh machine.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
REPO   ?= examples/model_repository
EXTRAS ?= onnx,torch,operator,test
PYTEST_ARGS ?=

.PHONY: venv serve test test-deps test-gpu examples bench e2e lint clean

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

test: venv test-deps
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

# Tools the test tiers use beyond Python packages: Debian's prometheus (scrape tests) and a real tritonserver
# from the nvidia-pytriton wheel (side-by-side comparison). Without them those tiers skip with a reason.
test-deps:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	   prometheus >/dev/null) ; } || echo "prometheus not installed: its tests will skip"
	@bash tools/triton/setup.sh >/dev/null || echo "real Triton unavailable: comparison tests will skip"

# GPU tier (needs a CUDA device; skips cleanly without one). Use a separate environment with the GPU extras:
#   make test-gpu VENV=.venv-gpu EXTRAS=gpu,torch,tensorrt,test
test-gpu: venv
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS) tests

lint: venv
	$(PY) -m ruff check server operator tests || true

clean:
	rm -rf $(VENV) $(REPO) .pytest_cache
