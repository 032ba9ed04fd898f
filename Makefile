# Two entry points, both for a fresh machine with no GPU (Python >= 3.11):
#   make demo   sets up and runs the main job (tiny GPT-MoE training with the plugin, CPU, gloo, EP=2)
#   make test   sets up and runs the tests (ruff lint + format check, pytest; GPU tests skip without CUDA)
PYTHON ?= python3

.PHONY: setup demo test lint

# An importable torch is kept (on a GPU machine it is usually a CUDA build that the default wheel would
# replace); torch==2.13.0 is installed only where none is importable, as on a fresh machine.
setup:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test]"

demo: setup
	$(PYTHON) examples/demo.py

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: setup lint
	$(PYTHON) -m pytest -q
