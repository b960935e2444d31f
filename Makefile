# Quick start (fresh machine, Python >= 3.10):
#   make bench   # set up .venv, then run the main job: a benchmark of all three optimizations
#   make test    # set up .venv, then run the whole test suite, notebooks included (smoke mode)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# CPU torch when there is no NVIDIA GPU; otherwise the CUDA build tested on the GPU machine (README, Versions).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo torch==2.11.0 || echo torch==2.13.0)
# Same command in the README and in .ci/run.
TEST_CMD = $(BIN)/python -m pytest tests notebooks --nbval-lax --nbval-current-env -p no:cacheprovider

# The tests that compare numbers, again on another CPU's kernels and one thread (CI runs both): torch picks its CPU
# kernels by ATEN_CPU_CAPABILITY, so a tolerance that only holds for this machine's kernels fails here (tests/conftest.py
# caps oneDNN at the same level: ONEDNN_MAX_CPU_ISA=AVX2).
OTHER_CPU ?= default
NUMERIC_TESTS = tests/integration/test_training.py tests/integration/test_loss.py tests/unit/test_moe_experts.py \
	tests/integration/test_moe_models.py tests/unit/test_offload_checkpoint.py tests/integration/test_offload_models.py \
	tests/integration/test_offload_memory.py tests/integration/test_offload_switch.py \
	tests/integration/test_offload_evidence.py tests/unit/test_packed_backends.py tests/unit/test_packed_flex.py \
	tests/integration/test_packed_models.py tests/integration/test_packed_switch.py tests/integration/test_packed_trl.py \
	tests/integration/test_lora.py tests/integration/test_collated_metadata.py tests/integration/test_compiled_layers.py \
	tests/distributed/test_distributed.py tests/integration/test_padding_free.py tests/integration/test_plan_exactness.py \
	tests/integration/test_plan_switch.py tests/integration/test_offload_saved.py tests/integration/test_dequant.py \
	tests/integration/test_toggles.py tests/integration/test_restore.py \
	notebooks/04_all_three_together.ipynb
# a timing scenario whose one equality compares a kernel set with itself (one process against DDP at world 1)
NUMERIC_SKIP = --deselect tests/distributed/test_distributed.py::test_bench_distributed_scenario_times_one_process_and_ddp_on_the_cpu

.PHONY: setup bench test test-other-cpu typecheck mutants clean

# Triton: a CUDA torch brings its own; on a CPU the fused kernels' tests run under its interpreter (so CI runs them)
$(BIN)/.ready: requirements.txt pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/python -m pip install -q triton==3.9.0
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

setup: $(BIN)/.ready

bench: $(BIN)/.ready
	$(BIN)/python -m fastsft_lab bench $(ARGS)

test: $(BIN)/.ready
	SMOKE=1 MPLBACKEND=Agg $(TEST_CMD)

test-other-cpu: $(BIN)/.ready
	ATEN_CPU_CAPABILITY=$(OTHER_CPU) OMP_NUM_THREADS=1 SMOKE=1 MPLBACKEND=Agg $(BIN)/python -m pytest $(NUMERIC_TESTS) \
		$(NUMERIC_SKIP) --nbval-lax --nbval-current-env -p no:cacheprovider

# mypy over the package (pyproject.toml [tool.mypy]: undefined names, wrong attribute access, bad calls)
typecheck: $(BIN)/.ready
	$(BIN)/python -m mypy fastsft_lab

# the curated mutation run (tests/mutations.py): every named bug in the core logic must fail the tests (~10 min)
mutants: $(BIN)/.ready
	$(BIN)/python tests/mutations.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
