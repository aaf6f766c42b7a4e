#!/usr/bin/env bash
# The browser tests (tests/test_browser*.py) drive Debian's chromium through Playwright, at /usr/bin/chromium; never
# `playwright install`. `make test` runs this first: it installs the package when it is missing (apt-get, as root or
# through sudo), and says so when it cannot, so a fresh machine's first `make test` does not error every browser
# test at setup.
set -euo pipefail
[ -x /usr/bin/chromium ] && exit 0
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
echo "chromium is missing (/usr/bin/chromium): installing Debian's package for the browser tests" >&2
$SUDO apt-get install -y chromium || { $SUDO apt-get update && $SUDO apt-get install -y chromium; } || {
  echo "could not install chromium: install Debian's 'chromium' package, or the browser tests will error" >&2
  exit 1
}
