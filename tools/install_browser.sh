#!/usr/bin/env bash
# Install Debian's Chromium for the browser test (tests/test_browser.py), where we may: as root
# with apt. Called only by `make test` (the command that runs that test); `make setup`,
# `make milestone`, `make lab` and `make models` never install a browser. Elsewhere it prints
# how to enable the test, which is then skipped with that reason. Always exits 0.
set -uo pipefail
[ -x /usr/bin/chromium ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[browser] installing chromium with apt, for tests/test_browser.py (once; a few minutes)"
  if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }; then
    exit 0
  fi
  echo "[browser] warning: could not install chromium with apt; tests/test_browser.py will be skipped" >&2
else
  echo "[browser] no /usr/bin/chromium: tests/test_browser.py will be skipped" \
       "(to run it: sudo apt-get install chromium)"
fi
exit 0
