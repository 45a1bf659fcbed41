# Two commands do all the set-up on a fresh machine:
#   make serve   make a virtual environment, install, then serve the embedded default model on 127.0.0.1:8000
#   make test    make a virtual environment, install (with the test extras), compile the kernels, run the test suite
# The environment is $(VENV) (default .venv beside this file); .ci/run points it at a fresh temporary one.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest -q -n 2 --dist worksteal
PIP := $(PY) -m pip

.PHONY: install install-test kernels serve generate test test-all

$(PY):
	python3 -m venv $(VENV)

# torch first, from this machine kind's disk (the CPU build); the project's range then installs nothing more
install: $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .

install-test: $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'

serve: install
	$(PY) -m deltaserve serve --host 127.0.0.1 --port 8000

generate: install
	$(PY) -m deltaserve generate --prompt "Hello, deltaserve" --max-tokens 32

# the project's C++ for every instruction set this CPU executes, compiled as an install compiles an extension:
# a compile error stops here with the compiler's message, and the suite's time is the tests'
kernels: install-test
	$(PY) -m deltaserve doctor --build

# two worker processes (pytest-xdist): most of the suite's time is one core's (servers starting, HTTP, Python), so
# two of them fill a 2-core machine; a test file alone still runs as `pytest tests/test_x.py`
test: kernels
	$(PYTEST)

test-all: kernels
	DELTASERVE_SLOW=1 $(PYTEST)
