# One Makefile for a fresh machine: `make run`, `make demo`, `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export PYTHONPATH := $(CURDIR)/platform:$(CURDIR)

.PHONY: setup migrate run demo test bench-deps clean

$(VENV)/.installed: pyproject.toml worker_client/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0   # first, so nothing later pulls a CUDA build
	$(PIP) install --quiet -e worker_client -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

migrate: setup
	$(PY) manage.py migrate --noinput

run: migrate  ## the platform on embedded defaults: web, Celery worker + beat, one local worker client
	bash scripts/run.sh

demo: setup  ## headless end to end: 3 worker clients train a 10-round FedAvg MLP on digits
	$(PY) scripts/demo.py

test: setup  ## the whole suite, on the local PostgreSQL and Redis (started if they are not answering)
	bash scripts/test.sh

bench-deps: setup  ## benchmark-only packages (flwr, for bench/aggregate.py)
	$(PIP) install --quiet flwr

clean:
	rm -rf var
