#!/usr/bin/env bash
# The test command (`make test`, and CI through it): PostgreSQL + Redis, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/muninn}"
export CELERY_BROKER_URL="${CELERY_BROKER_URL:-redis://127.0.0.1:6379/0}"
export PYTHONPATH="$PWD/platform:$PWD"
# The test settings: DEBUG on at import (a development secret key, plain HTTP for the live servers the suite
# starts); pytest-django still runs every test with settings.DEBUG off, as users meet the site.
export DEBUG="${DEBUG:-1}"
exec .venv/bin/python -m pytest "$@"
