# Naiad: `make serve` and `make test` do all set-up on a fresh machine.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
UV     := $(VENV)/bin/uv
UV_VERSION := 0.13.10
REPO   ?= examples/model_repository
EXTRAS ?= onnx,torch,fil,s3,otel,analyze,operator,test
PYTEST_ARGS ?=

.PHONY: tools server-tools server-deps-background image-tests cluster-tools cluster-tools-background venv serve test worker-tests test-deps test-gpu e2e-build e2e-tests e2e-bench e2e-density e2e-images e2e-image-tests e2e-node-tests examples bench e2e lint clean crds dashboards helm-lint images images-cuda images-llm e2e-llm-image-tests

venv: $(VENV)/.installed

# uv installs the dependencies: its cache (~/.cache/uv) keeps every wheel it fetched, so a fresh clone's virtualenv
# is made in ~15 s once the cache is warm (pip's took ~10 min each time: the registry's answers are not cacheable,
# and torch's CUDA wheels alone are 4.5 GB); cold, it fetches in parallel (~1.5 min against pip's ~10).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -x $(UV) && [ "$$($(UV) --version | cut -d' ' -f2)" = $(UV_VERSION) ] || $(PY) -m pip install -q uv==$(UV_VERSION)
	$(UV) pip install -q --python $(PY) -e '.[$(EXTRAS)]'
	touch $@

examples: $(REPO)/.built

$(REPO)/.built: venv examples/build_repository.py $(shell find examples/src -type f 2>/dev/null)
	$(PY) examples/build_repository.py --out $(REPO)
	touch $@

serve: venv examples llm-deps
	$(VENV)/bin/naiad serve --model-repository $(REPO) --http-port 8000 --grpc-port 8001 --metrics-port 8002

CLUSTER_TESTS := tests/operator/test_operator_cluster.py tests/operator/test_operator_ha_cluster.py \
  tests/operator/test_operator_keda_cluster.py \
  tests/operator/test_operator_s3_cluster.py tests/operator/test_operator_llm_cluster.py \
  tests/operator/test_operator_lws_cluster.py tests/operator/test_helm_chart.py
SCALE_BENCH := tests/operator/test_operator_scale.py

# Every tier this machine can run: server, Triton side by side, Prometheus, operator, the e2e cluster, the images,
# and the e2e cluster again with every pod and the operator started from the built images.
# A cold run is CPU-bound until the cluster tools are built and mostly idle after, so the order is:
# - at once, before the virtualenv (they need none): the cluster tiers' builds (`cluster-tools`: Kubernetes and etcd
#   alone take ~20 min of both cores cold) in the background at the lowest CPU priority (nice 19), taking what
#   everything else leaves idle; and what the server tier needs that needs no virtualenv (`server-deps-background`:
#   MinIO, the OpenTelemetry Collector, h2spec, llama-cpp-python and rpc-server) at normal priority;
# - the virtualenv, lint, the examples; `server-tools llm-deps` then only wait for the background's builds (each
#   build holds a lock: a second build of the same thing waits for the first and finds it done, or reports its
#   error);
# - the images (~10 min of CPU cold) in the background at nice 19 too, sharing with the cluster tools what the
#   tests leave: the cluster tier needs them as well (e2e's real node and pod runner start the server image);
# - the server tier, then the workers pass beside what follows; once the cluster tools and the images are built,
#   side by side the cluster tier and the image tiers (the built images run, then the cluster scenarios with every
#   pod started from them). Each cluster tier's pytest process has a network namespace, a cluster and a pod network
#   of its own. The side tiers' output follows the cluster tier's, then a per-tier summary.
# Free disk is sampled every 10 s from the server tier on (build/disk-free.log) and the least printed at the end:
# CI's run of one tree failed on a full disk. Under CI=true a skipped test fails the run unless it is a GPU test
# skipped for lack of a device (conftest.py).
test: export NAIAD_GO_RUN_CACHES := $(CURDIR)/build/go-caches
test:
	@mkdir -p build; rm -f build/steps.tsv
	@$(MAKE) -s cluster-tools-background server-deps-background
	@tools/step_time.sh venv $(MAKE) -s venv
	@tools/step_time.sh test-deps $(MAKE) -s test-deps
	@tools/step_time.sh lint $(MAKE) -s lint
	@tools/step_time.sh "server tools, examples, llm deps" $(MAKE) -s -j3 server-tools examples llm-deps
	@rm -f build/images.rc; (exec 7>build/images.lock; flock 7; \
	  nice -n 19 tools/step_time.sh images $(MAKE) -s images images-llm >build/images.log 2>&1; echo $$? >build/images.rc) &
	@rm -rf .test-results; status=0; \
	( while kill -0 $$$$ 2>/dev/null; do df -Pm . | awk 'NR == 2 { print $$4 }'; sleep 10; done >build/disk-free.log 2>/dev/null ) & \
	NAIAD_TEST_RUN=server $(PY) -m pytest -q -rfEs $(SERVER_TIER_ARGS) $(PYTEST_ARGS) tests $(CLUSTER_TESTS:%=--ignore=%) \
	  --ignore=$(SCALE_BENCH) $(IMAGE_TESTS:%=--ignore=%) || status=$$?; \
	$(MAKE) -s worker-tests >build/worker-tests.log 2>&1 & workers=$$!; \
	tools/step_time.sh "cluster tools (wait)" $(MAKE) -s cluster-tools || { status=$$?; tail -n 30 build/cluster-tools.log; }; \
	flock build/images.lock true; [ "$$(cat build/images.rc 2>/dev/null)" = 0 ] || \
	  { status=1; echo "the images did not build:"; tail -n 40 build/images.log; }; \
	$(MAKE) -s image-tests >build/image-tests.log 2>&1 & images=$$!; \
	$(MAKE) -s e2e-tests || status=$$?; \
	wait $$workers || status=$$?; echo "== the workers pass (--frontend-workers 2)"; cat build/worker-tests.log; \
	wait $$images || status=$$?; echo "== the images and the image tier"; cat build/image-tests.log; \
	$(PY) tools/test_summary.py .test-results || status=$$?; \
	echo "least free disk during the tests: $$(sort -n build/disk-free.log | head -n 1) MiB (README, Tests: disk)"; \
	rm -rf "$$NAIAD_GO_RUN_CACHES"; exit $$status

# The server tier's test files on two pytest-xdist workers, each file on one worker (its module-scoped servers
# start once): on two cores a test spends much of its time waiting for a server to start or answer.
SERVER_TIER_ARGS ?= -n 2 --dist loadfile

# What the server tier needs that needs no virtualenv, started with the cluster tools' builds (`make test`):
# llama-cpp-python's wheel, rpc-server and llama-server built with the interpreter the virtualenv is made from (the
# wheel only depends on its version; `llm-deps` installs it), the Go servers the server tier starts, the real small models
# the quality tests use (tools/models/fetch.sh). Output in
# build/server-deps.log; a failure here is retried, and reported, by `llm-deps` and `server-tools`.
server-deps-background:
	@mkdir -p build; ( { tools/step_time.sh "llama.cpp (background)" env PYTHON=$(PYTHON) bash tools/llama_cpp/build.sh servers & \
	  tools/step_time.sh "server tools (background)" $(MAKE) -s server-tools & \
	  tools/step_time.sh "real models (background)" sh -c 'tools/models/fetch.sh smollm2 && tools/models/fetch.sh minilm'; \
	  wait; } >build/server-deps.log 2>&1 & )

# The protocol tests again with every server started with `--frontend-workers 2` (two worker processes in front of
# one engine process), the Triton comparison included: the multi-process server must answer as one process does
# (differences found this way: Retry-After and the on-demand load wait lost between the processes, a huge request's
# memory kept by the slab pools, a structured-output spec the model cannot follow reported without its field). ~3 min.
WORKER_TESTS := tests/test_triton_compare.py tests/test_http.py tests/test_grpc.py tests/test_sequence.py \
  tests/test_decoupled.py tests/test_on_demand.py tests/test_generate_extension.py tests/test_openai.py \
  tests/test_client_parity.py tests/test_stats.py tests/test_large_tensors.py tests/test_compression_attacks.py \
  tests/test_openai_structured_output.py tests/test_llm_hostile.py
worker-tests:
	@NAIAD_TEST_RUN=server-workers NAIAD_TEST_EXTRA_ARGS="--frontend-workers 2" \
	  $(PY) -m pytest -q -rfEs $(PYTEST_ARGS) $(WORKER_TESTS)

# The cluster tiers run in a pytest process of their own: the e2e pod network moves that process into a
# private network namespace, which must happen before any test starts a thread. The operator's scenarios come first
# and e2e/ (the real node last) after them: in `make test` the image tiers run beside this one and are done by then.
# Their failed tests run once more (tools/pytest_retry.sh): one that passes then is listed in the summary as flaky,
# one that fails twice fails the run.
e2e-tests:
	@bin=$$($(MAKE) -s e2e-build 2>/dev/null | tail -n 1); \
	if [ -n "$$bin" ] && [ -x "$$bin/kube-apiserver" ]; then export NAIAD_E2E_BIN="$$bin"; \
	else echo "Kubernetes binaries unavailable: cluster tiers will skip"; fi; \
	PY=$(PY) bash tools/pytest_retry.sh cluster -q -rfEs $(PYTEST_ARGS) $(CLUSTER_TESTS) e2e

# The e2e scenarios and the operator's cluster scenarios again with every pod (and the operator) started from the
# built images (`make images`), as a node would run them: each container in a PID namespace of its own under
# bubblewrap (e2e/images.py). Part of `make test`, after the host-virtualenv tiers; about 4 minutes. The
# LeaderWorkerSet scenario's leader and rpc-server worker run from the LLM image (`make images-llm`; ~25 s more).
# The Ray group scenarios (engine vllm, and a Triton LLM repository's vllm_backend) run their pods from this
# environment (the vllm stand-in, Ray): no image has vLLM and Ray.
NOT_RAY_GROUPS := --deselect tests/operator/test_operator_lws_cluster.py::test_a_vllm_copy_larger_than_a_node_joins_its_group_with_ray \
  --deselect tests/operator/test_operator_lws_cluster.py::test_a_triton_llm_repository_larger_than_a_node_joins_its_group_with_ray
e2e-image-tests:
	@bin=$$($(MAKE) -s e2e-build 2>/dev/null | tail -n 1); export NAIAD_E2E_BIN="$$bin" NAIAD_E2E_IMAGES=1; \
	PY=$(PY) bash tools/pytest_retry.sh cluster-images -q -rfEs $(PYTEST_ARGS) e2e tests/operator/test_operator_cluster.py \
	  tests/operator/test_operator_s3_cluster.py tests/operator/test_operator_lws_cluster.py --ignore=e2e/test_real_node.py \
	  $(NOT_RAY_GROUPS)

# The built images themselves (tests/test_images.py: each started from its archive as a container runtime would),
# then the cluster scenarios with every pod started from them (`e2e-image-tests`). Needs `make images images-llm`.
IMAGE_TESTS := tests/test_images.py
image-tests:
	@status=0; NAIAD_TEST_RUN=images $(PY) -m pytest -q -rfEs $(PYTEST_ARGS) $(IMAGE_TESTS) || status=$$?; \
	$(MAKE) -s e2e-image-tests || status=$$?; exit $$status

# The LLM cluster scenarios in image mode (needs `make images images-llm`): the LeaderWorkerSet's leader and
# rpc-server worker, and the llama.cpp model's pods (InferencePool, HPA, endpoint picker), started from the LLM
# server image. The LLM scenario (~1 min 45 s here) is not part of `make test`'s image tier; the LWS one is.
e2e-llm-image-tests:
	@bin=$$($(MAKE) -s e2e-build 2>/dev/null | tail -n 1); export NAIAD_E2E_BIN="$$bin" NAIAD_E2E_IMAGES=1; \
	NAIAD_TEST_RUN=cluster-llm-images $(PY) -m pytest -q -rfEs $(PYTEST_ARGS) tests/operator/test_operator_lws_cluster.py \
	  tests/operator/test_operator_llm_cluster.py $(NOT_RAY_GROUPS)

# The real node alone (e2e/node: containerd, runc, CNI, kubelet, kube-proxy; the server image imported into
# containerd; `make test-deps` installs them). `make e2e-tests` runs it with the rest of e2e/; ~2 min warm.
e2e-node-tests:
	@command -v go >/dev/null || export PATH="$$PATH:/usr/local/go/bin"; bash tools/go/build.sh e2e-node >/dev/null
	@bin=$$($(MAKE) -s e2e-build 2>/dev/null | tail -n 1); export NAIAD_E2E_BIN="$$bin"; \
	NAIAD_TEST_RUN=cluster-node $(PY) -m pytest -q -rfEs $(PYTEST_ARGS) e2e/test_real_node.py

# The operator's scale benchmark (300 InferenceModels on 3 pools; about 13 minutes with the small latency scenario):
# API requests per minute from the API server's own metrics, apply -> Available p50/p95 and where it goes.
# NAIAD_BENCH_OUT=<file> keeps the figures (the small scenario's in <file>-small).
e2e-bench:
	@bin=$$($(MAKE) -s e2e-build 2>/dev/null | tail -n 1); export NAIAD_E2E_BIN="$$bin"; \
	$(PY) -m pytest -q -s -m bench -k 'not density' $(PYTEST_ARGS) $(SCALE_BENCH)

# Density (docs/operator.md, "Density"): 1,000 InferenceModels on one pool of 3 real servers (requests/min,
# apply -> Available, convergence after a pod is lost), then 100 small models resident on one server (load time,
# RSS, per-model memory, first request). NAIAD_BENCH_OUT=<file> keeps the figures in <file>-density/-resident;
# NAIAD_DENSITY_MODELS (1000) runs it smaller.
e2e-density:
	@bin=$$($(MAKE) -s e2e-build 2>/dev/null | tail -n 1); export NAIAD_E2E_BIN="$$bin"; \
	$(PY) -m pytest -q -s -m bench -k density $(PYTEST_ARGS) $(SCALE_BENCH)

# Every server and tool a test tier runs, built or installed before any test starts: the Go servers the server
# tier starts, the cluster binaries (and helm), and each other Go tool pinned under tools/go/ (cached by content in
# ~/.cache/naiad-tools).
tools: server-tools cluster-tools

SERVER_GO_TOOLS := h2spec minio otelcol
server-tools:
	@command -v go >/dev/null || export PATH="$$PATH:/usr/local/go/bin"; \
	for t in $(SERVER_GO_TOOLS); do bash tools/go/build.sh $$t >/dev/null || exit $$?; done

# The cluster tiers' builds: Kubernetes, etcd, kwok, helm, prometheus-adapter (e2e-build, itself two streams), and
# beside it, one after another, every other tools/go server (KEDA, LeaderWorkerSet, the endpoint picker, the real
# node's helpers: ~25 min of CPU cold, which used to wait for Kubernetes to finish), then the CRDs they apply.
cluster-tools:
	@command -v go >/dev/null || export PATH="$$PATH:/usr/local/go/bin"; \
	$(MAKE) -s e2e-build >/dev/null & e2e=$$!; status=0; \
	for t in tools/go/*/; do t=$$(basename $$t); [ -f "tools/go/$$t/go.mod" ] || continue; \
	  case " $(SERVER_GO_TOOLS) " in *" $$t "*) continue;; esac; bash tools/go/build.sh $$t >/dev/null || status=$$?; done; \
	wait $$e2e || status=$$?; exit $$status
	@command -v go >/dev/null || export PATH="$$PATH:/usr/local/go/bin"; bash tools/gie/crds.sh >/dev/null
	@command -v go >/dev/null || export PATH="$$PATH:/usr/local/go/bin"; bash tools/lws/crds.sh >/dev/null
	@command -v go >/dev/null || export PATH="$$PATH:/usr/local/go/bin"; bash tools/keda/crds.sh >/dev/null

# `make test`'s first step: the cluster tools' builds in the background (their output in build/cluster-tools.log).
cluster-tools-background:
	@mkdir -p build; (nice -n 19 tools/step_time.sh "cluster tools (background)" $(MAKE) -s cluster-tools >build/cluster-tools.log 2>&1 &)

# llama-cpp-python (the llamacpp backend) compiled once from its sdist, with llama.cpp's rpc-server and llama-server
# from the same source, cached in ~/.cache/naiad-tools and installed into the virtualenv (tools/llama_cpp/build.sh).
llm-deps: venv
	@PYTHON=$(PY) bash tools/llama_cpp/build.sh >/dev/null
	@# rpc-server too: the RPC tests (tests/test_llamacpp_rpc.py) and the LeaderWorkerSet scenario run it; and
	@# llama-server (`servers` builds both; 28 min once per pin on 2 shared cores): tests/test_llamacpp_lora.py
	@# compares an adapter's greedy tokens with `llama-server --lora`
	@PYTHON=$(PY) bash tools/llama_cpp/build.sh servers >/dev/null

# Builds kube-apiserver, controller-manager, scheduler, kubectl, kubelet, kube-proxy, etcd, kwok, helm and prometheus-adapter from
# the official Go modules (pinned in e2e/cluster) into a cache; prints the bin directory last.
e2e-build:
	@command -v go >/dev/null || export PATH="$$PATH:/usr/local/go/bin"; \
	command -v go >/dev/null && bash e2e/cluster/build.sh

e2e: venv test-deps
	$(MAKE) -s e2e-tests

# The cluster tiers in image mode alone (images built first): the pod runner starts the server pods from the built
# server image and the operator runs from its image with a ServiceAccount token (e2e/images.py). `make e2e` keeps
# the faster host-virtualenv mode, which runs the worktree's code without a rebuild.
e2e-images: venv test-deps images images-llm
	$(MAKE) -s e2e-image-tests

crds: venv
	$(PY) crds/generate.py

dashboards: venv
	$(PY) dashboards/generate.py

helm-lint:
	@bin=$$($(MAKE) -s e2e-build | tail -n 1); "$$bin/helm" lint --strict helm/naiad

# The server (VARIANT=cpu|cuda, backends IMAGE_EXTRAS=...) and operator images, built with buildah (no Docker
# engine needed), as docker-archive tarballs in build/images with their image IDs and sizes (tools/images/build.sh).
images:
	@bash tools/images/build.sh

# The CUDA server image (onnxruntime-gpu with CUDA and cuDNN from PyPI's nvidia-* wheels: 2.7 GiB; ~4 min warm,
# ~12 GB of disk at the peak), checked by importing its backends (no GPU needed), and the operator image. Not part
# of `make test`. CUDA_EXTRAS=gpu-wheels,torch,s3 adds torch (README, "Images": ~6.6 GiB; ~30 GB at the peak).
CUDA_EXTRAS ?=
images-cuda:
	@VARIANT=cuda IMAGE_EXTRAS=$(CUDA_EXTRAS) bash tools/images/build.sh

# The LLM server image, ghcr.io/naiad-dev/naiad-server:<version>-llm: the CPU image plus llama-cpp-python and
# llama.cpp's rpc-server (Dockerfile.llm), compiled once by tools/llama_cpp/build.sh and cached; the
# operator runs `llm.engine: llamacpp` pools and LeaderWorkerSets from it. Writes build/images/naiad-server-llm.tar.
images-llm:
	@VARIANT=llm bash tools/images/build.sh

bench: venv
	bash bench/setup.sh
	$(PY) bench/run.py $(BENCH_ARGS)

# Tools the test tiers use beyond Python packages: Debian's prometheus (scrape tests) and a real tritonserver
# from the nvidia-pytriton wheel (side-by-side comparison). Without them those tiers skip with a reason.
test-deps:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	   prometheus >/dev/null) ; } || echo "prometheus not installed: its tests will skip"
	@command -v containerd >/dev/null && command -v runc >/dev/null && [ -x /usr/lib/cni/bridge ] && command -v wrk >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && (apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends containerd runc \
	  containernetworking-plugins iptables wrk >/dev/null) ; } || echo "containerd/runc/CNI not installed: the real-node tests will skip"
	@bash tools/triton/setup.sh >/dev/null || echo "real Triton unavailable: comparison tests will skip"
	@PYTHON=$(PY) bash tools/perf_analyzer/setup.sh >/dev/null || echo "perf_analyzer unavailable: its tests will skip (fail under CI=true)"

# GPU tier (needs a CUDA device; skips cleanly without one). Use a separate environment with the GPU extras:
#   make test-gpu VENV=.venv-gpu EXTRAS=gpu,torch,tensorrt,fil,test
test-gpu: venv
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS) tests

# Lint, format and type checks, no import cycles, and the server's imports down its declared rooms
# (tools/import_rooms.py, docs/architecture.md); each fails on a finding (rule sets chosen in pyproject.toml).
lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m mypy operator/naiad_operator
	$(PY) tools/import_cycles.py server operator
	$(PY) tools/import_rooms.py server

clean:
	rm -rf $(VENV) $(REPO) .pytest_cache
