# Everything a user or CI runs goes through here; each target sets up the venv first.
#   make demo                 set up, then run the demo on a tiny DeepseekV3 (CPU)
#   make demo-images          the same with images: a tiny Qwen2.5-VL through SGLang's multimodal path
#   make test                 set up, then run every test (real SGLang servers on CPU, Ray, S3)
#   make test-fast            set up, then run tests/unit: no server, no Ray, no S3 (< 3 min)
#   make bench [BENCH=name]   set up, then run every benchmark, or one
#   make campaign [SEED=n] [CAMPAIGN=--short]   set up, then run the fault campaign (capture and
#                             generate jobs; short: CI's; times: docs/testing.md)
#   make proof                set up, then the proof by serving (tools/draft_proof.py): a draft
#                             trained on our data is accepted by SGLang, shifted layers are not
#   make docs                 regenerate docs/configuration.md from the config models
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.setup-done
# The released trainers the export tests run (requirements/trainers.txt): a venv of their own
# over the project's packages.
TRAINERS_VENV := .venv-trainers
TRAINERS_STAMP := $(TRAINERS_VENV)/.setup-done
SETUP_INPUTS := Makefile pyproject.toml setup.py hsx_kernels/fp8_cpu.c \
	requirements/sglang-cpu.lock.txt requirements/project.txt requirements/bench.txt \
	shims/sgl_kernel/pyproject.toml $(wildcard shims/sgl_kernel/src/sgl_kernel/*.py)
BENCH ?=
SEED ?= 0
CAMPAIGN ?=

.PHONY: setup demo demo-images test test-fast bench campaign proof docs lint clean

setup: $(STAMP) $(TRAINERS_STAMP)

# Order matters: SGLang's CPU dependency lock first, then sglang itself without its (CUDA)
# dependencies, then ours, then the benchmarks' peer (SpecForge, without the torch/sglang it
# pins), then the import-only sgl_kernel shim, then this project (editable, which registers the
# plugin's `sglang.srt.plugins` entry point, and builds the C kernels in hsx_kernels/).
$(STAMP): $(SETUP_INPUTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements/sglang-cpu.lock.txt
	$(PIP) install --no-deps sglang==0.5.23
	$(PIP) install -r requirements/project.txt
	$(PIP) install --no-deps -r requirements/bench.txt
	rm -rf shims/sgl_kernel/build
	$(PIP) install --no-deps --force-reinstall ./shims/sgl_kernel
	$(PIP) install --no-deps --no-build-isolation -e .
	$(PY) -m tools.check_env
	touch $(STAMP)

# No pip of its own: the project venv's pip installs into it (--python), --no-deps; the .pth
# file adds the project venv's site-packages after its own, as a site directory, so its own
# .pth files run too (the editable install of this project: examples/ import it).
$(TRAINERS_STAMP): $(STAMP) requirements/trainers.txt
	rm -rf $(TRAINERS_VENV)
	$(PYTHON) -m venv --without-pip $(TRAINERS_VENV)
	$(PY) -c "import site; print(f'import site; site.addsitedir({site.getsitepackages()[0]!r})')" > \
		"$$($(TRAINERS_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/project-venv.pth"
	$(PIP) --python $(TRAINERS_VENV)/bin/python install --no-deps -r requirements/trainers.txt
	$(TRAINERS_VENV)/bin/python -c "import speculators.train.data, specforge.runtime.data_plane.offline_reader, hsx_store"
	touch $(TRAINERS_STAMP)

demo: setup
	$(PY) -m tools.demo

demo-images: setup
	$(PY) -m tools.demo --images

test: setup
	$(PY) -m pytest

# The markers come from the fixtures a test uses (tests/conftest.py); tests/unit holds none of
# these, and the selection says so again.
test-fast: setup
	$(PY) -m pytest tests/unit -m "not (server or ray or s3 or trainers)"

bench: setup
	$(PY) -m benchmarks.run $(BENCH)

campaign: setup
	$(PY) -m tools.fault_campaign --seed $(SEED) $(CAMPAIGN)

proof: setup
	$(PY) -m tools.draft_proof

docs: setup
	$(PY) -m tools.config_reference

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf $(VENV) $(TRAINERS_VENV) .cache out build hsx_kernels/*.so
