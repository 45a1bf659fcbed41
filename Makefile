# Two commands do all the set-up on a fresh machine:
#   make serve   install, then serve the embedded default model on 127.0.0.1:8000
#   make test    install, then run the test suite
PY ?= python3
PIP = $(PY) -m pip

.PHONY: install install-test serve generate test test-all bench
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .

install-test:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'

serve: install
	deltaserve serve --host 127.0.0.1 --port 8000

generate: install
	deltaserve generate --prompt "Hello, deltaserve" --max-tokens 32

test: install-test
	$(PY) -m pytest -q

test-all: install-test
	DELTASERVE_SLOW=1 $(PY) -m pytest -q
