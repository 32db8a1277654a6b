# The README's two commands: `make demo` and `make test`. Each creates .venv if needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all test-gpu clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m moejax.demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu"

test-all: $(STAMP)
	$(PY) -m pytest -q

# On a machine with a CUDA GPU (the compiled kernels vs the references).
test-gpu: $(STAMP)
	MOEJAX_GPU_TESTS=1 $(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) runs
