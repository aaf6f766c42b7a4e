# One Makefile for a fresh machine: `make run`, `make demo`, `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export PYTHONPATH := $(CURDIR)/platform:$(CURDIR)

.PHONY: setup migrate run demo test test-fast bench-deps clean

$(VENV)/.installed: pyproject.toml worker_client/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0   # first, so nothing later pulls a CUDA build
	$(PIP) install --quiet -e worker_client -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

migrate: setup  ## also makes the site's secret key (kept in $$MUNINN_VAR_DIR/secret-key, default var/)
	@d="$${MUNINN_VAR_DIR:-var}"; mkdir -p "$$d"; [ -s "$$d/secret-key" ] || \
	  (umask 077; $(PY) -c 'import secrets; print(secrets.token_urlsafe(50))' >"$$d/secret-key")
	$(PY) manage.py migrate --noinput

run: migrate  ## the platform on embedded defaults: web, Celery worker + beat, one local worker client
	bash scripts/run.sh

demo: setup  ## headless end to end: 3 worker clients train a 10-round FedAvg MLP on digits
	$(PY) scripts/demo.py

test: setup  ## the whole suite, on the local PostgreSQL and Redis (started if they are not answering)
	bash scripts/chromium.sh
	bash scripts/test.sh -n 2 --dist loadfile --no-loadscope-reorder --durations=20

test-fast: setup  ## for quick local runs: all but the real-process suites and the API contract run (CI runs all)
	bash scripts/test.sh -m "not faults and not e2e and not browser and not contract"

bench-deps: setup  ## benchmark-only packages: flwr's aggregate (bench/aggregate.py), aiohttp and uvloop (bench/load.py)
	# --no-deps: flwr pins packaging<26 (kombu pins 26.3) and pulls ~35 server packages; this is the minimal
	# set under which `flwr.server.strategy.aggregate` imports and runs.
	# httpx comes whole (httpcore, h11, anyio): the stripe library builds an httpx client when httpx imports.
	$(PIP) install --quiet --no-deps flwr==1.41.0 protobuf==6.33.6 grpcio==1.85.1 httpx==0.28.1 httpcore==1.0.9 \
	  h11==0.16.0 anyio==4.16.0 typer==0.20.1 \
	  rich==14.3.4 pycryptodome==3.24.1 cryptography==50.0.2 cffi==2.1.1 iterators==0.0.2
	# aiohttp: bench/load.py's 200 simulated devices on one core (attrs, idna, typing_extensions are already in).
	$(PIP) install --quiet --no-deps aiohttp==3.14.3 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 \
	  multidict==6.9.1 propcache==0.5.4 yarl==1.25.1
	# uvloop: the simulated devices' event loop (bench/load.py --loop uvloop, its default), cheaper per wake-up.
	$(PIP) install --quiet --no-deps uvloop==0.23.0

clean:
	rm -rf var
