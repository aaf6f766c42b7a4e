#!/usr/bin/env bash
# `make run`: the whole platform on one machine with the embedded defaults (SQLite, filesystem broker,
# local media): the web server, a Celery worker, Celery beat and one local worker client. Ctrl-C stops all.
#
# The platform keeps running when the local worker client exits: this script says which process ended, with its
# exit code and the last lines of its log, and when the worker's device was quarantined, the command that lifts
# the quarantine. A platform process (web, Celery worker, beat) that ends stops everything, with the same report.
# Logs are appended to (never truncated), each run starting with a dated line.
set -euo pipefail
cd "$(dirname "$0")/.."
# This checkout's worker client first, whatever an editable install elsewhere points at.
export PYTHONPATH="$PWD/platform:$PWD:$PWD/worker_client"
export MUNINN_VAR_DIR="${MUNINN_VAR_DIR:-$PWD/var}"
# Every customer who signs up gets this much to try the site with (no Stripe here); `MUNINN_DEMO_CREDIT=0 make run`
# turns it off. The site's own default, outside `make run`, is 0.
export MUNINN_DEMO_CREDIT="${MUNINN_DEMO_CREDIT:-100.00}"
PY="${MUNINN_PYTHON:-.venv/bin/python}"
CELERY="$(dirname "$PY")/celery"
HOST="${MUNINN_HOST:-127.0.0.1}"
PORT="${MUNINN_PORT:-8000}"
URL="http://$HOST:$PORT"
VAR="$MUNINN_VAR_DIR"
LOG="$VAR/log"
mkdir -p "$LOG"
worker_config="$VAR/worker-client.json"
worker_cmd=("$PY" -m muninn_worker run --config "$worker_config" --server "$URL" --cache-dir "$VAR/worker-cache")

# The site as its users meet it: DEBUG off, so errors are the site's own 403/404/500 pages rather than Django's
# debug pages (whitenoise still serves the static files). Set DEBUG=true to get the debug pages back. Plain HTTP
# on this machine: MUNINN_TLS=false (no HTTPS redirect, cookies not marked Secure).
export DEBUG="${DEBUG:-false}" MUNINN_TLS="${MUNINN_TLS:-false}" ALLOWED_HOSTS="${ALLOWED_HOSTS:-$HOST,localhost,127.0.0.1}"
[ -s "$VAR/secret-key" ] || (umask 077; $PY -c 'import secrets; print(secrets.token_urlsafe(50))' >"$VAR/secret-key")
export SECRET_KEY="${SECRET_KEY:-$(cat "$VAR/secret-key")}"

logins=$($PY manage.py seed_demo)
contributor_token=$($PY -c 'import json,sys; print(json.loads(sys.argv[1])["contributor"]["token"])' "$logins")

declare -A names=() logs=()
pids=()
cleanup() { trap - INT TERM EXIT; echo; echo "stopping…"; kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup INT TERM EXIT

# start NAME LOGFILE COMMAND...: run it in the background, appending to its log after a dated line.
start() {
  local name=$1 log=$2; shift 2
  echo "=== $(date -u '+%Y-%m-%d %H:%M:%S UTC') make run: starting $name ($*) ===" >>"$log"
  "$@" >>"$log" 2>&1 &
  pids+=($!); names[$!]=$name; logs[$!]=$log
}

start "the web server" "$LOG/web.log" "$PY" manage.py runserver --noreload "$HOST:$PORT"
start "the Celery worker" "$LOG/celery-worker.log" "$CELERY" -A muninn worker --loglevel=INFO --concurrency=1 \
  --without-mingle --without-gossip -Q celery,validation
start "Celery beat" "$LOG/celery-beat.log" "$CELERY" -A muninn beat --loglevel=INFO

for _ in $(seq 1 60); do curl -fsS "$URL/healthz" >/dev/null 2>&1 && break; sleep 0.5; done
if [ ! -f "$worker_config" ]; then
  "$PY" -m muninn_worker register --server "$URL" --token "$contributor_token" --name local-worker \
    --config "$worker_config"
fi
device_id=$($PY -c 'import json,sys; print(json.load(open(sys.argv[1])).get("device_id") or "")' "$worker_config")
start "the local worker client" "$LOG/worker-client.log" "${worker_cmd[@]}"
worker_pid=$!

cat <<MSG

Muninn is running at $URL  (API: $URL/api/, admin: $URL/admin/)
  customer     customer / muninn-customer         (€100 demo credit)
  contributor  contributor / muninn-contributor   (one local worker client attached)
  staff        staff / muninn-staff
$(if [ "$MUNINN_DEMO_CREDIT" != 0 ]; then echo "New customers who sign up get a $MUNINN_DEMO_CREDIT demo credit (MUNINN_DEMO_CREDIT)."; fi)
Logs in $LOG/ (appended to on every run). Ctrl-C stops everything.
MSG

# The device's standing, and how to put it back to work, when the local worker client has ended.
worker_ended() {
  [ -n "$device_id" ] || return 0
  local standing
  standing=$($PY manage.py device_quarantine "$device_id" 2>&1) || true
  echo "  device: $standing"
  if [[ $standing == quarantined* ]]; then
    cat <<MSG
  Its work is refused until staff lift the quarantine (on $URL/staff/, or here):
    $PY manage.py device_quarantine $device_id --lift --reason "local demo worker checked" --by staff
  or register a new device instead (its old record and held earnings stay for review):
    rm $worker_config   # then start make run again: it registers a new local worker
MSG
  fi
  echo "  Start it again (the platform is still running):"
  echo "    ${worker_cmd[*]} >>$LOG/worker-client.log 2>&1 &"
}

live=("${pids[@]}")
while [ ${#live[@]} -gt 0 ]; do
  ended="" rc=0
  wait -n -p ended "${live[@]}" || rc=$?
  [ -n "$ended" ] || continue
  rest=()
  for p in "${live[@]}"; do [ "$p" = "$ended" ] || rest+=("$p"); done
  live=("${rest[@]}")
  echo
  echo "make run: ${names[$ended]} (pid $ended) ended with exit code $rc. The last lines of ${logs[$ended]}:"
  tail -n 15 "${logs[$ended]}" | sed 's/^/  | /'
  if [ "$ended" = "$worker_pid" ]; then
    worker_ended
  else
    echo "make run: the platform cannot run without ${names[$ended]}; stopping everything."
    exit 1
  fi
done
