# The two quick-start commands: `make demo` (the resume demo) and `make test` (every test).
# Both create the virtual environment they need: torch==2.13.0 first (the CPU wheel on
# this machine's disk; an unpinned torch would pull a multi-GB CUDA build), then statekit
# and every plugin under plugins/ with pip, so the plugins' entry points are real.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PLUGINS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
STAMP := $(VENV)/.statekit-installed

.PHONY: demo demo-all test test-fast install clean

demo: $(STAMP)
	$(PY) examples/resume_demo.py

# The demo on all three storages: local disk, memory:// and a local moto S3 server.
demo-all: $(STAMP)
	$(PY) examples/resume_demo.py
	$(PY) examples/resume_demo.py --url memory://statekit-demo
	$(PY) examples/resume_demo.py --moto

# The core's tests, then each plugin's tests from its own directory (each is its own
# distribution with its own conftest); every suite runs, and any failure fails the target.
PYTEST = $(abspath $(PY)) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test: $(STAMP)
	@status=0; \
	$(PYTEST) tests || status=1; \
	for plugin in $(PLUGINS); do \
		echo "== $$plugin"; (cd $$plugin && $(PYTEST) tests) || status=1; \
	done; \
	exit $$status

test-fast: $(STAMP)
	$(MAKE) test PYTEST_ARGS='-m "not slow"'

install: $(STAMP)

$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[accelerate,s3,demo,test]' $(addprefix -e ,$(PLUGINS))
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs
