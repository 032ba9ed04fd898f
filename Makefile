# Two entry points, both for a fresh machine with no GPU (Python >= 3.11):
#   make demo   sets up and runs the main job (tiny GPT-MoE training with the plugin, CPU, gloo, EP=2)
#   make test   sets up and runs the tests (ruff lint + format check, pytest; GPU tests skip without CUDA)
PYTHON ?= python3

.PHONY: setup demo test lint test-triton-oldest

# The oldest Triton that pyproject.toml admits (its lower bound) and the tests that run our Triton kernels
# (interpreted on CPU). `make test` runs them under the Triton that pip resolved (the newest one admitted, on a
# fresh machine); `make test-triton-oldest` under this one.
TRITON_OLDEST := 3.4.0
TRITON_TESTS := tests/test_triton_round.py tests/test_triton_interpret.py tests/test_triton_topk_softmax.py \
	tests/test_triton_ep_send.py tests/test_token_dispatch_triton.py tests/test_shared_softmax.py tests/test_wgrad_pairs.py \
	tests/test_triton_round_ep.py tests/test_triton_ep_send_csr.py tests/test_triton_slots.py \
	tests/test_triton_compile.py
TRITON_OLDEST_DIR ?= $(HOME)/.cache/sonic_megatron/triton-$(TRITON_OLDEST)

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

# The Triton kernel tests under TRITON_OLDEST, installed once (with numpy < 2.4: Triton's interpreter needs it
# before Triton 3.7) into a folder that goes first on PYTHONPATH: the environment itself stays as it is.
test-triton-oldest: setup
	test -f $(TRITON_OLDEST_DIR)/.complete || { rm -rf $(TRITON_OLDEST_DIR) && \
		$(PYTHON) -m pip install -q --no-deps --target $(TRITON_OLDEST_DIR) triton==$(TRITON_OLDEST) "numpy<2.4" && \
		touch $(TRITON_OLDEST_DIR)/.complete; }
	PYTHONPATH=$(TRITON_OLDEST_DIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -c \
		"import triton; assert triton.__version__ == '$(TRITON_OLDEST)', triton.__version__"
	PYTHONPATH=$(TRITON_OLDEST_DIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m pytest -q -p no:cacheprovider \
		-W "ignore:Conversion of an array with ndim > 0:DeprecationWarning:triton.runtime.interpreter" $(TRITON_TESTS)
