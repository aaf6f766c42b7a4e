#!/usr/bin/env bash
# `make run`: the whole platform on one machine with the embedded defaults (SQLite, filesystem broker,
# local media): the web server, a Celery worker, Celery beat and one local worker client. Ctrl-C stops all.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/platform:$PWD"
PY=.venv/bin/python
HOST="${MUNINN_HOST:-127.0.0.1}"
PORT="${MUNINN_PORT:-8000}"
URL="http://$HOST:$PORT"
mkdir -p var/log

# The site as its users meet it: DEBUG off, so errors are the site's own 403/404/500 pages rather than Django's
# debug pages (whitenoise still serves the static files). Set DEBUG=true to get the debug pages back.
export DEBUG="${DEBUG:-false}" ALLOWED_HOSTS="${ALLOWED_HOSTS:-$HOST,localhost,127.0.0.1}"
[ -s var/secret-key ] || (umask 077; $PY -c 'import secrets; print(secrets.token_urlsafe(50))' >var/secret-key)
export SECRET_KEY="${SECRET_KEY:-$(cat var/secret-key)}"

logins=$($PY manage.py seed_demo)
contributor_token=$($PY -c 'import json,sys; print(json.loads(sys.argv[1])["contributor"]["token"])' "$logins")

pids=()
cleanup() { trap - INT TERM EXIT; echo; echo "stopping…"; kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup INT TERM EXIT

$PY manage.py runserver --noreload "$HOST:$PORT" >var/log/web.log 2>&1 & pids+=($!)
.venv/bin/celery -A muninn worker --loglevel=INFO --concurrency=1 --without-mingle --without-gossip -Q celery,validation \
  >var/log/celery-worker.log 2>&1 & pids+=($!)
.venv/bin/celery -A muninn beat --loglevel=INFO >var/log/celery-beat.log 2>&1 & pids+=($!)

for _ in $(seq 1 60); do curl -fsS "$URL/healthz" >/dev/null 2>&1 && break; sleep 0.5; done
worker_config=var/worker-client.json
if [ ! -f "$worker_config" ]; then
  .venv/bin/muninn-worker register --server "$URL" --token "$contributor_token" --name local-worker \
    --config "$worker_config"
fi
.venv/bin/muninn-worker run --config "$worker_config" --server "$URL" --cache-dir var/worker-cache >var/log/worker-client.log 2>&1 & pids+=($!)

cat <<MSG

Muninn is running at $URL  (API: $URL/api/, admin: $URL/admin/)
  customer     customer / muninn-customer         (€100 demo credit)
  contributor  contributor / muninn-contributor   (one local worker client attached)
  staff        staff / muninn-staff
Logs in var/log/. Ctrl-C stops everything.
MSG
wait -n "${pids[@]}"
