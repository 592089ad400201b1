# Quick start:  make demo   (set up + generate with k3-tiny on CPU)
#               make test   (set up + run the test suite; .ci/run calls this)
PY ?= python3
VENV := .venv
# CPU build of torch (on this project's machines the CPU wheel is on disk; elsewhere pick your build)
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@

.PHONY: setup demo test
setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/k3compile generate --model k3-tiny --prompt "def fib(n):" --max-new-tokens 32 --show-ids

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q
