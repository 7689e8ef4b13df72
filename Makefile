# The two quick-start commands: `make demo` (the resume demo) and `make test` (every test).
# Both create the virtual environment they need: torch==2.13.0 first (the CPU wheel on
# this machine's disk; an unpinned torch would pull a multi-GB CUDA build), then statekit
# and every plugin under plugins/ with pip, so the plugins' entry points are real.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PLUGINS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
STAMP := $(VENV)/.statekit-installed

.PHONY: demo demo-preempt demo-preempt-eval demo-all demo-trainer test test-fast coverage install clean docs package template-test lint bench-setup house

demo: $(STAMP)
	$(PY) examples/resume_demo.py

# The demo preempted: SIGTERM (not SIGKILL) at a random step; the run saves that step
# (CheckpointManager(save_on_signal=True)), exits 143, and the next start resumes from it.
demo-preempt: $(STAMP)
	$(PY) examples/resume_demo.py --preempt

# The SIGTERM lands 1 s into a 60 s evaluation (no step boundary for a minute): the manager's
# watcher thread saves the last step at once and the run exits 143 mid-evaluation.
demo-preempt-eval: $(STAMP)
	$(PY) examples/resume_demo.py --preempt-eval

# The same kill-and-resume proof through transformers' Trainer (statekit-transformers): a
# small GPT-2 on the digits as token sequences, SIGKILL mid-epoch, train(resume_from_checkpoint=True).
demo-trainer: $(STAMP)
	$(PY) examples/trainer_demo.py

# The demo on all three storages: local disk, memory:// and a local moto S3 server; then
# with gradient accumulation (saves fall between optimizer steps); then two-tier: local disk
# replicated to moto S3, the resumed run on a fresh node (empty local root) resumes from S3.
demo-all: $(STAMP)
	$(PY) examples/resume_demo.py
	$(PY) examples/resume_demo.py --url memory://statekit-demo
	$(PY) examples/resume_demo.py --moto
	$(PY) examples/resume_demo.py --grad-accum 4
	$(PY) examples/resume_demo.py --replicate-to moto
	$(PY) examples/resume_demo.py --preempt --grad-accum 4

# The tests come in two tiers, each in its own folder (tests/README.md): tests/unit (in-process,
# by package: seconds each) and tests/integration (real processes: torchrun, signals, killed
# saves, the moto S3 server, trainings, Accelerate's own tests, the docs' code). Each plugin's
# tests/ has the same two folders (a plugin without integration tests has no
# tests/integration). `make test` runs both tiers of the core, then each plugin's
# tests from its own directory (each is its own distribution with its own conftest); every
# suite runs, and any failure fails the target. `make test-fast` runs the unit tiers only.
# Both tiers of the core run on two pytest-xdist workers (-n 2); the integration tier hands
# out whole files (--dist loadfile), so a module's shared fixture (Accelerate's conformance
# runs, a reference training) is built once, on one worker.
PYTEST = $(abspath $(PY)) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
XDIST ?= -n 2
TIERS ?= unit integration

test: $(STAMP)
	@status=0; \
	for tier in $(TIERS); do \
		echo "== tests/$$tier"; \
		if [ $$tier = unit ]; then $(PYTEST) $(XDIST) tests/unit || status=1; \
		else $(PYTEST) $(XDIST) --dist loadfile tests/$$tier || status=1; fi; \
	done; \
	for plugin in $(PLUGINS); do \
		echo "== $$plugin"; \
		dirs=; for tier in $(TIERS); do [ -d $$plugin/tests/$$tier ] && dirs="$$dirs tests/$$tier"; done; \
		[ -z "$$dirs" ] || (cd $$plugin && $(PYTEST) $$dirs) || status=1; \
	done; \
	exit $$status

test-fast: $(STAMP)
	$(MAKE) test TIERS=unit

# Line and branch coverage of statekit and the plugins by every test (not part of CI; the
# numbers in tests/README.md). Serial runs (xdist's workers are not traced), processes the
# tests start are not traced; the line and branch totals are the last lines of the output.
COVERAGE_SOURCE := statekit,statekit_replicate,statekit_rng,statekit_diffusers,statekit_fsdp,statekit_offload,statekit_transformers
COVERAGE = COVERAGE_FILE=$(abspath .coverage) $(abspath $(PY)) -m coverage
COVERAGE_RUN = $(COVERAGE) run --branch --parallel-mode --source=$(COVERAGE_SOURCE) -m pytest -q -p no:cacheprovider -p no:xdist

coverage: $(STAMP)
	rm -f .coverage .coverage.* coverage.json
	-$(COVERAGE_RUN) tests
	-for plugin in $(PLUGINS); do (cd $$plugin && $(COVERAGE_RUN) tests); done
	$(COVERAGE) combine -q
	$(COVERAGE) report --skip-covered --sort=cover | tail -n 25
	$(COVERAGE) json -q -o $(abspath coverage.json)
	$(PY) .ci/coverage_totals.py coverage.json

install: $(STAMP)

# The layer contract and the plugin-API contract (import-linter, [tool.importlinter] in
# pyproject.toml): a module imports only layers below it; plugins only statekit.plugin_api.
lint: $(STAMP)
	$(VENV)/bin/lint-imports

# Benchmark setup: fio (Debian package) for the disk limits of bench/run.py (which also
# runs this script itself when fio is missing). Needs root or sudo; does nothing if fio is there.
bench-setup:
	bash bench/setup.sh

# The house's size and shape (issue 37): code and docstring lines apart, the highest
# cyclomatic complexities; REV=<commit> measures another commit for a before/after.
house: $(STAMP)
	$(PY) -m pip install -q -e '.[measure]'
	$(PY) bench/house.py $(if $(REV),--rev $(REV))

# The documentation site (MkDocs + Material + mkdocstrings), into site/. --strict: a broken
# link, a missing page or reference, or a docstring griffe cannot parse fails the build.
DOCS_STAMP := $(VENV)/.statekit-docs-installed

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Wheels and sdists of statekit, every plugin and the plugin template, installed into a
# fresh virtual environment and smoke-tested there (.ci/package.sh).
package: $(STAMP)
	PY=$(abspath $(PY)) bash .ci/package.sh

# The plugin template, as a third party would use it: pip install (not editable), run its
# tests from its own directory, then uninstall it so it does not join other test runs.
TEMPLATE := examples/plugin-template

template-test: $(STAMP)
	$(PY) -m pip install -q --no-deps ./$(TEMPLATE)
	@status=0; (cd $(TEMPLATE) && $(PYTEST) tests) || status=1; \
	rm -rf $(TEMPLATE)/build; \
	$(PY) -m pip uninstall -q -y statekit-metrics; \
	exit $$status

$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[accelerate,s3,demo,test]' $(addprefix -e ,$(PLUGINS))
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs site .coverage .coverage.* coverage.json
