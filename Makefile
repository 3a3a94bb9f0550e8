# Entry points. Every target prints what it does; `make help` lists them.
# TARGET=cpu|cuda selects the vLLM build for .venv; VLLM_VERSION=x.y.z another pin.
# GROUP=project|regression|upstream|e2e and ARGS='<pytest args>' narrow `make test`.
PY ?= python3
S := $(PY) scripts
GROUP ?=
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help apply env checkout test test-unpatched check patches lint e2e e2e-unpatched e2e-gpu bench bench-gpu clean wheel

help: ## list the targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

apply: ## fetch + verify vLLM, build build/vllm with patches/, build .venv (patched)
	@$(S)/make_env.py --preflight
	@$(S)/apply.py
	@$(S)/make_env.py

checkout: ## build/vllm: pristine tag + one commit per patch (idempotent; FORCE=1 discards local work)
	@$(S)/apply.py

wheel: ## build/wheels/: the pinned wheel of TARGET with the series, RECORD verified, to pip install
	@$(S)/make_wheel.py

env: ## .venv for TARGET (cpu default, cuda for GPU runners), importing the patched vLLM
	@$(S)/make_env.py

test: check ## all tests, offline (GROUP=name ARGS='-k x' for one group or test); one summary
	@$(S)/run_tests.py $(GROUP) $(if $(ARGS),-- $(ARGS))

test-unpatched: ## the regression tests against pristine vLLM: shows them failing (exits non-zero)
	@$(S)/run_tests.py --unpatched $(GROUP) $(if $(ARGS),-- $(ARGS))

check: ## patches/ and vllm_overlay/ agree, and .venv holds the patched files
	@$(S)/check_sync.py

patches: ## export build/vllm's commits to patches/ and regenerate vllm_overlay/
	@$(S)/export_patches.py

lint: ## vLLM's ruff (its pyproject.toml) on every Python file the series touches
	@$(S)/lint.py

e2e: ## the upstream test plan (vllm serve + lm_eval) on tiny HMA models, CPU matrix (~65 min)
	@.venv/bin/python e2e/run_plan.py

e2e-unpatched: ## the plan on pristine vLLM: HMA models refused at start-up, control passes
	@.venv/bin/python e2e/run_plan.py --unpatched

e2e-gpu: ## the plan with real CUDA handlers (real models when the hub is reachable)
	@.venv/bin/python e2e/run_gpu.py

bench: ## patched vs pristine scheduler cost, fs tier vs raw disk, HMA cost (BENCH_QUICK=1: ~1 min)
	@.venv/bin/python bench/run_bench.py

bench-gpu: ## the benchmark on a GPU runner; prints "no GPU" and exits 0 without one
	@.venv/bin/python bench/gpu_bench.py

clean: ## remove build/ and .venv (the download cache stays); refuses unexported work in build/vllm
	@$(S)/clean.py
