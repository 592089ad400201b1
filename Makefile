# Quick start:  make demo   (set up + generate with k3-tiny on CPU)
#               make test   (set up + run the test suite; .ci/run calls this)
PY ?= python3
VENV := .venv
# CPU build of torch (on this project's machines the CPU wheel is on disk; elsewhere pick your build)
TORCH ?= torch==2.13.0

# --no-compile: no bytecode for every file of every package at install (113 -> 52 s here); Python compiles what it
# imports, once, on first use
$(VENV)/.installed: pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q --no-compile "$(TORCH)"
	$(VENV)/bin/python -m pip install -q --no-compile -e ".[test]"
	touch $@

.PHONY: setup demo test chromium
setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/k3compile generate --model k3-tiny --prompt "def fib(n):" --max-new-tokens 32 --show-ids

# headless Chromium renders `report --html` in its test (skipped without it); Debian/Ubuntu package name
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { command -v apt-get >/dev/null 2>&1 && (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1; } || \
	  echo "chromium not installed: the HTML rendering test will be skipped"

# the two set-up steps side by side on CI's two cores: the pip installs (~50 s on a clean clone here since they skip bytecode; 168-180 s before) and
# Chromium's apt install (40 s when missing), each waiting on its own downloads and unpacking
test:
	$(MAKE) -j2 $(VENV)/.installed chromium
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --durations=25
