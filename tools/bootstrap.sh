#!/usr/bin/env bash
# Create .venv with a supported Python and install the workbook (editable) with its pinned
# dependencies. Called by `make setup`; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

pick_python() {
  for cand in "${PYTHON:-}" python3.11 python3.12 python3.10 python3; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || continue
    if "$cand" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 12) else 1)'; then
      echo "$cand"; return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(pick_python) || {
    echo "setup: no Python 3.10-3.12 found (tried \$PYTHON, python3.11, python3.12, python3.10, python3)." >&2
    echo "setup: install Python 3.11 and rerun, or point PYTHON at it: make PYTHON=/path/to/python3.11 test" >&2
    exit 1
  }
  echo "[setup] creating .venv with $($py --version)"
  "$py" -m venv .venv
fi
echo "[setup] installing minisgl and its pinned dependencies into .venv (first time: about a minute on an idle machine, 8 minutes or more on a busy one)"
if ! .venv/bin/python -m pip install --disable-pip-version-check -q -e '.[dev,convert]'; then
  echo "setup: pip could not install the packages above. Check that pip reaches the package index" >&2
  echo "setup: (proxy settings, 'pip config list'), then rerun 'make setup'." >&2
  exit 1
fi
# Chapter 07's fused kernels (an Engine built with cpu_kernels=True) compile C++ on first use;
# without a compiler such an Engine says so and runs the chapters' code. Install g++ where we may
# (root with apt). No browser is installed
# here: tools/install_browser.sh, run by `make test` only, installs Chromium for the browser test.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  echo "[setup] installing g++ with apt (for minisgl.kernel's C++ kernels)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++; }; then
    echo "setup: warning: could not install g++; cpu_kernels=True Engines will run the chapters' code" >&2
  fi
fi
# Every kernel of this venv runs tools/kernel_startup.py: %%writefile under minisgl/ backs up
# work before replacing it, even in a notebook whose first cell has not run.
mkdir -p .venv/etc/ipython
cat > .venv/etc/ipython/ipython_kernel_config.py <<'CONFIG'
# Written by tools/bootstrap.sh (make setup): a kernel started inside a minisgl workbook checkout
# runs the checkout's tools/kernel_startup.py (the workbook's %%writefile, which backs up work).
c.InteractiveShellApp.exec_lines = [
    "def _minisgl_workbook_startup():\n"
    "    import pathlib, runpy\n"
    "    here = pathlib.Path.cwd().resolve()\n"
    "    for folder in (here, *here.parents):\n"
    "        script = folder / 'tools' / 'kernel_startup.py'\n"
    "        if script.is_file():\n"
    "            runpy.run_path(str(script))\n"
    "            return\n"
    "_minisgl_workbook_startup()\n"
    "del _minisgl_workbook_startup",
]
CONFIG
echo "[setup] done"
