PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= .models/small-moe
STAMP := $(VENV)/.installed

.PHONY: install system-packages test serve clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

system-packages:
	bash scripts/system-packages.sh

test: install system-packages
	$(BIN)/python -m pytest

$(MODEL)/config.json: | install
	$(BIN)/tokenmill make-model --preset small-moe --out $(MODEL)

serve: install $(MODEL)/config.json
	$(BIN)/tokenmill serve --model $(MODEL)

clean:
	rm -rf $(VENV) .models
