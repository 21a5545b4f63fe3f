"""Every chapter notebook, run the way a learner runs it: in JupyterLab, in a real browser.

nbmake executes notebooks but renders nothing, so a widget that shows nothing in JupyterLab (a
missing or mismatched `jupyterlab_widgets`), a figure that never displays or a kernel that cannot
import `minisgl` passes every other test. This file starts `jupyter lab` from the project's
environment on a temporary copy of the repository and drives headless Chromium (Debian's
/usr/bin/chromium) with Playwright; one server and one browser serve every notebook in turn.

- solutions/NN_*.ipynb: Run -> Run All Cells; every code cell must run without an error output,
  every ipywidgets output must render as live widget views and redraw its picture when a slider
  moves, and every figure must show as an image. A screenshot of the chapter's first picture is
  saved to tests/screenshots/NN_slug.png (git-ignored).
- workspace/notebooks/NN_*.ipynb (the learner's copies, made from notebooks/ as `make lab` makes
  them): their %%writefile cells write stubbed modules into the copy's workspace/minisgl/. Running all cells must
  either succeed or stop first at an exercise stub: the first error a learner sees must be
  `NotImplementedError: Exercise N.M: ...`. The copy's packages are restored from the checkout
  before every notebook.

Nothing in the checkout changes except tests/screenshots/. Needs Chromium at /usr/bin/chromium
(`sudo apt-get install chromium`; `make test` installs it when run as root with apt) and the
`playwright` package from the dev extra; otherwise the tests are skipped, saying so.
MINISGL_BROWSER_NOTEBOOKS=01,04 limits the chapters. The limit for running one notebook adapts
to the machine: MINISGL_BROWSER_TIMEOUT (seconds, default 600) on an unloaded machine, stretched
by how overloaded it is while the notebook runs (1-minute load average / cores, up to 4x). When
it runs out, the message says what the kernel was doing: computing, idle, or waiting (for a
file lock held by another process, for example).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from minisgl.utils.env import env_error, read_env

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "tests" / "screenshots"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NB_TIMEOUT = read_env("MINISGL_BROWSER_TIMEOUT", float, 600.0, low=1, high=86400)  # unloaded
MAX_STRETCH = 4.0  # a busy machine stretches the limit at most this much
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# What JupyterLab shows instead of a widget when its front end is missing or broken.
WIDGET_FALLBACKS = ("Loading widget...", "Error displaying widget", "Failed to load model class",
                    "Widget Javascript not detected")
WIDGET_REPR = re.compile(r"^\s*(interactive|[A-Z]\w*(Slider|Box|Button|Dropdown|Output|Text|"
                         r"Checkbox|Select\w*))\((children|value|description|options|layout)=")
FIGURE_REPR = re.compile(r"^\s*<Figure size [\d.]+x[\d.]+ with \d+ Axes>\s*$")
STUB = re.compile(r"^Exercise (\d+)\.(\d+): \S")

pytestmark = pytest.mark.browser


def _venv_bin(name: str) -> Path:
    """The project's environment: .venv/ in the checkout, else the one running pytest."""
    venv = ROOT / ".venv" / "bin" / name
    return venv if venv.exists() else Path(sys.executable).parent / name


VENV_PY, JUPYTER = _venv_bin("python"), _venv_bin("jupyter")


def _why_not_runnable() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return ("the `playwright` package is missing: install the dev extra "
                "(`.venv/bin/pip install -e '.[dev]'`, part of `make setup`)")
    if not CHROMIUM.exists():
        return ("Chromium is not installed at /usr/bin/chromium: to enable the browser test run "
                "`sudo apt-get install chromium` (or run `make test` as root, which installs it)")
    if not JUPYTER.exists():
        return f"no JupyterLab at {JUPYTER}: run `make setup`"
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return "the browser test copies the checkout with `git ls-files`; no git checkout here"
    return None


def _chapters() -> set[str] | None:
    raw = read_env("MINISGL_BROWSER_NOTEBOOKS", str, "")
    if not raw:
        return None
    parts = [x for x in re.split(r"[,\s]+", raw) if x]
    for x in parts:
        if not (x.isascii() and x.isdigit() and int(x) <= 99):
            raise env_error("MINISGL_BROWSER_NOTEBOOKS", os.environ["MINISGL_BROWSER_NOTEBOOKS"],
                            f"is not an accepted value ({x!r} is not a chapter number)",
                            "chapter numbers separated by commas, e.g. 01,04")
    return {f"{int(x):02d}" for x in parts}


def _notebooks(folder: str) -> list[str]:
    wanted = _chapters()
    found = sorted(p.stem for p in (ROOT / folder).glob("[0-9][0-9]_*.ipynb"))
    return [stem for stem in found if wanted is None or stem[:2] in wanted]


# ---------------------------------------------------------------------------------------------
# the temporary copy, the server, the browser


def _checkout_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                         check=True, stdout=subprocess.PIPE).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (ROOT / f).is_file()})




def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM (and stops its kernels) if pytest itself is killed."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


class Lab:
    """A JupyterLab server on a temporary copy of the repository."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.work = tmp / "repo"
        self.port = _free_port()
        self.token = secrets.token_hex(24)
        self.base = f"http://127.0.0.1:{self.port}"
        self.runtime = tmp / "runtime"
        self.proc: subprocess.Popen | None = None
        self.log = tmp / "jupyter.log"
        self.reference = tmp / "minisgl-reference"  # the checkout's minisgl/, as copied

    def prepare(self) -> None:
        for rel in _checkout_files():
            (self.work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, self.work / rel)
        shutil.copytree(self.work / "minisgl", self.reference)
        # the learner's workspace, as `make lab` makes it: their copies of the chapters (without
        # the skip-execution tag) beside their own package
        from tools import workbook as wb

        for path in sorted((self.work / "notebooks").glob("[0-9][0-9]_*.ipynb")):
            wb.write_file(self.work / wb.WORKSPACE / "notebooks" / path.name,
                          wb.learner_copy(path.read_bytes()))
        if (ROOT / "models").exists():
            (self.work / "models").symlink_to(ROOT / "models")
            (self.work / wb.WORKSPACE / "models").symlink_to(Path("..") / "models",
                                                            target_is_directory=True)
        # The kernel must be the project's environment: a `python3` kernelspec naming its python,
        # first on JUPYTER_PATH, so no user- or system-wide spec can shadow it.
        _write_json(self.tmp / "share/jupyter/kernels/python3/kernel.json", {
            "argv": [str(VENV_PY), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (minisgl .venv)", "language": "python"})
        settings = self.tmp / "settings"
        for plugin, values in {
            # start the notebook's kernel without the "Select Kernel" dialog; attach every cell
            # to the DOM; no autosave; no news/update pop-ups (and no request to the internet)
            "notebook-extension/tracker": {"autoStartDefaultKernel": True,
                                           "windowingMode": "none"},
            "docmanager-extension/plugin": {"autosave": False},
            "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        }.items():
            _write_json(settings / f"@jupyterlab/{plugin}.jupyterlab-settings", values)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JUPYTER", "IPYTHON", "MPLBACKEND", "PYTEST"))}
        env.update(JUPYTER_RUNTIME_DIR=str(self.runtime), JUPYTER_CONFIG_DIR=str(self.tmp / "config"),
                   JUPYTER_DATA_DIR=str(self.tmp / "data"), JUPYTER_PATH=str(self.tmp / "share/jupyter"),
                   IPYTHONDIR=str(self.tmp / "ipython"),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONDONTWRITEBYTECODE="1",
                   # the chapter tests run in pytest's own step: the notebooks' test cells say so
                   # instead of running them a third time (this test is about the page)
                   MINISGL_SKIP_CHAPTER_TESTS="1")
        return env

    def start(self) -> None:
        cmd = [str(JUPYTER), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
               "--port-retries=0", f"--IdentityProvider.token={self.token}",
               f"--ServerApp.root_dir={self.work}", f"--LabApp.user_settings_dir={self.tmp / 'settings'}",
               f"--LabApp.workspaces_dir={self.tmp / 'workspaces'}",
               "--LabApp.expose_app_in_browser=True", "--ServerApp.open_browser=False"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        # preexec_fn is safe here: the server starts before Playwright starts any thread.
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.work, env=self.env(), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True,
                                         preexec_fn=_die_with_parent)  # noqa: PLW1509
        limit = 120 * load_stretch()
        deadline = time.monotonic() + limit
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                return
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"jupyter lab did not answer in {limit:.0f} s:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.5)

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def api(self, method: str, path: str):
        req = urllib.request.Request(f"{self.base}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """End every session (and its kernel) so the next notebook starts on a quiet machine."""
        try:
            for s in self.api("GET", "/api/sessions"):
                self.api("DELETE", f"/api/sessions/{s['id']}")
            for k in self.api("GET", "/api/kernels"):
                self.api("DELETE", f"/api/kernels/{k['id']}")
        except (OSError, urllib.error.URLError):
            pass
        self._kill_stray_kernels(signal.SIGTERM)

    def kernels(self) -> dict[int, list[str]]:
        """pid -> command line of each live kernel this server started (it names a connection
        file in this server's runtime dir)."""
        marker, found = str(self.runtime), {}
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if "ipykernel_launcher" in argv and any(a.startswith(marker) for a in argv):
                found[int(proc.name)] = argv
        return found

    def _kill_stray_kernels(self, sig) -> None:
        """Kernels run in their own process groups (with the chapter tests they started)."""
        for pid in self.kernels():
            try:
                if os.getpgid(pid) == pid:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self) -> None:
        if self.proc is None:
            return
        self.shutdown_kernels()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        self._kill_stray_kernels(signal.SIGKILL)

    def kernel_python(self) -> str:
        spec = self.api("GET", "/api/kernelspecs")["kernelspecs"]["python3"]["spec"]
        return spec["argv"][0]


# ---------------------------------------------------------------------------------------------
# how busy the machine is, and what a slow notebook's kernel is doing


def load_stretch() -> float:
    """How overloaded the machine is: 1-minute load average / CPU cores, from 1 to MAX_STRETCH."""
    try:
        return min(MAX_STRETCH, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))
    except OSError:
        return 1.0


def _stat(pid: int) -> tuple[int, str, float] | None:
    """(parent pid, state letter, CPU seconds used) of a process, from /proc/<pid>/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(roots) -> dict[int, tuple[int, str, float]]:
    """The processes `roots` and all their descendants: pid -> _stat(pid)."""
    stats = {int(p.name): st for p in Path("/proc").glob("[0-9]*") if (st := _stat(int(p.name)))}
    tree, todo = {}, [pid for pid in roots if pid in stats]
    while todo:
        pid = todo.pop()
        tree[pid] = stats[pid]
        todo += [child for child, st in stats.items() if st[0] == pid and child not in tree]
    return tree


def _cmdline(pid: int) -> str:
    """A process's command line on one line (at most 160 characters)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        return " ".join(raw.replace("\0", " ").split())[:160]
    except OSError:
        return "?"


def lock_waits(pids) -> list[str]:
    """Files that these processes have open and that another process holds a lock on (flock or
    fcntl, from /proc/locks): what a kernel waiting for a lock is waiting for."""
    holders = {}  # inode -> pid holding a lock on it
    try:
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if "->" not in parts and len(parts) >= 6:  # "->" marks a blocked waiter
                holders[int(parts[5].rsplit(":", 1)[1])] = int(parts[4])
    except (OSError, ValueError, IndexError):
        return []
    found = []
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                inode, path = fd.stat().st_ino, os.readlink(fd)
            except OSError:
                continue
            holder = holders.get(inode)
            if holder is not None and holder not in pids:
                found.append(f"process {pid} has {path} open, locked by process {holder} "
                             f"({_cmdline(holder)})")
    return sorted(set(found))


def kernel_activity(lab: Lab, status: str, sample_s: float = 5.0) -> str:
    """One paragraph on what the notebook's kernel is doing: computing, idle, or waiting."""
    kernels = list(lab.kernels())
    if not kernels or not Path("/proc/self/stat").exists():
        return f"JupyterLab reports the kernel {status!r} (no process details on this system)"
    before = process_tree(kernels)
    time.sleep(sample_s)
    after = process_tree(kernels)
    used = sum(st[2] - before[pid][2] for pid, st in after.items() if pid in before)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    procs = ", ".join(f"{pid} {st[1]} {_cmdline(pid)[:60]!r}" for pid, st in sorted(after.items()))
    machine = f"load average {load:.1f} on {os.cpu_count()} cores"
    if status == "idle":
        verdict = "idle: the kernel has finished, yet the page still shows a cell as running"
    elif used >= 0.1 * sample_s:
        verdict = (f"computing: its processes used {used:.1f} CPU-seconds in {sample_s:.0f} s; "
                   "the notebook is slow, not stuck")
    else:
        waits = lock_waits(set(after))
        verdict = (f"waiting: its processes used {used:.2f} CPU-seconds in {sample_s:.0f} s"
                   + (" - for a lock: " + "; ".join(waits) if waits else
                      " (blocked on something other than a file lock: I/O, another process, "
                      "a network call)"))
    return (f"the kernel (JupyterLab: {status!r}) was {verdict}; {machine}; "
            f"processes (pid, state, command): {procs}")


def restore_package(lab: Lab) -> None:
    """Make the copy's minisgl/ and its workspace's minisgl/ the checkout's again (learner
    notebooks overwrite the workspace's with stubs), from the snapshot taken when the copy was
    made."""
    for tree in (lab.work, lab.work / "workspace"):
        shutil.rmtree(tree / "minisgl", ignore_errors=True)
        shutil.copytree(lab.reference, tree / "minisgl")


@pytest.fixture(scope="module")
def lab(request):
    reason = _why_not_runnable()
    if reason:
        pytest.skip(reason)
    # `kill` (SIGTERM) of pytest: stop like Ctrl-C, so the finalizers below still run.
    previous = signal.getsignal(signal.SIGTERM)
    stopping = []

    def interrupt(signum, frame):
        if not stopping:  # once only, and never in the middle of the clean-up below
            stopping.append(signum)
            raise KeyboardInterrupt(f"signal {signum}")

    if previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, interrupt)
        request.addfinalizer(lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    tmp = Path(tempfile.mkdtemp(prefix="minisgl-browser-"))
    server = Lab(tmp)
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    request.addfinalizer(server.stop)
    request.addfinalizer(lambda: stopping.append("teardown"))  # runs first
    server.prepare()
    server.start()
    kernel_py = server.kernel_python()
    assert Path(kernel_py).resolve() == VENV_PY.resolve(), (
        f"JupyterLab's python3 kernel runs {kernel_py}, not the project's environment {VENV_PY}")
    return server


@pytest.fixture(scope="module")
def browser(lab, request):
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    request.addfinalizer(pw.stop)
    context = pw.chromium.launch_persistent_context(
        str(lab.tmp / "chromium-profile"), executable_path=str(CHROMIUM), headless=True,
        args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 1000})
    request.addfinalizer(context.close)
    # Log in once: the token sets the server's cookie for every later page.
    page = context.new_page()
    page.goto(f"{lab.base}/lab?token={lab.token}", timeout=120_000 * load_stretch())
    page.close()
    return context


# ---------------------------------------------------------------------------------------------
# one notebook in the page

# State of the open notebook, read from JupyterLab's own objects (the page exposes the app
# through --LabApp.expose_app_in_browser) plus the DOM each output rendered to. JupyterLab 4
# renders an error output exactly like stderr (a <div data-mime-type="application/vnd.jupyter.
# stderr">, no distinguishing class), so which outputs are errors is read from the cell models.
STATE_JS = r"""
(path) => {
  const app = window.jupyterapp;
  if (!app) return null;
  const panel = Array.from(app.shell.widgets('main')).find(w => w.context && w.context.path === path);
  if (!panel || !panel.context.isReady) return null;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const dialogs = Array.from(document.querySelectorAll('.jp-Dialog')).map(d => d.innerText);
  const cells = panel.content.widgets.map((cell, i) => {
    const m = cell.model;
    const src = m.sharedModel.getSource();
    const info = {index: i, type: m.type, head: src.split('\n')[0].slice(0, 90), outputs: []};
    if (m.type !== 'code') return info;
    const prompt = cell.node.querySelector('.jp-InputArea-prompt');
    info.count = m.executionCount;
    info.prompt = prompt ? prompt.innerText.trim() : '';
    const children = cell.outputArea ? cell.outputArea.widgets : [];
    for (let k = 0; k < m.outputs.length; k++) {
      const o = m.outputs.get(k), json = o.toJSON();
      const node = children[k] ? children[k].node : null;
      const rendered = node ? node.querySelector('.jp-OutputArea-output') : null;
      info.outputs.push({
        type: o.type, mimes: Object.keys(o.data || {}),
        ename: json.ename || null, evalue: json.evalue || null,
        domMime: rendered ? (rendered.dataset.mimeType || '') : null,
        text: node ? node.innerText.slice(0, 400) : '',
        tail: node ? node.innerText.slice(-800) : '',
        widgets: node ? node.querySelectorAll('.jupyter-widgets').length : 0,
        sliders: node ? node.querySelectorAll('.noUi-handle, input[type=range]').length : 0,
        imgs: node ? Array.from(node.querySelectorAll('img')).map(im => ({
          png: im.src.startsWith('data:image/png'), ok: im.complete && im.naturalWidth > 0})) : [],
        svgs: node ? node.querySelectorAll('[data-mime-type="image/svg+xml"] svg').length : 0,
      });
    }
    return info;
  });
  return {status: kernel ? kernel.status : 'no kernel', kernelName: kernel ? kernel.name : null,
          dirty: panel.context.model.dirty, dialogs, cells};
}
"""

# The rendered output `k` of cell `i` (a .jp-OutputArea-child), tagged so Playwright can find it.
TAG_JS = r"""
([path, i, k, tag]) => {
  const panel = Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.context && w.context.path === path);
  const node = panel.content.widgets[i].outputArea.widgets[k].node;
  node.setAttribute('data-browser-test', tag);
  return true;
}
"""


class Notebook:
    def __init__(self, lab: Lab, context, rel: str):
        self.lab, self.rel = lab, rel
        self.page = context.new_page()
        self.console: list[str] = []
        self.page.on("console", lambda m: self.console.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.console.append(str(e)))
        self.page.on("dialog", lambda d: d.accept())

    def close(self) -> None:
        try:
            self.page.close()
        finally:
            self.lab.shutdown_kernels()

    def state(self):
        return self.page.evaluate(STATE_JS, self.rel)

    def console_tail(self) -> str:
        msgs = list(dict.fromkeys(m for m in self.console if "favicon" not in m))[-6:]
        return ("\nbrowser console errors:\n  " + "\n  ".join(m[:300] for m in msgs)) if msgs else ""

    def open(self) -> dict:
        ws = re.sub(r"\W", "-", self.rel)  # a fresh workspace per notebook: nothing else reopens
        limit = 120 * load_stretch()
        self.page.goto(f"{self.lab.base}/lab/workspaces/{ws}/tree/{self.rel}", timeout=limit * 1000)
        deadline = time.monotonic() + limit
        while True:
            st = self.state()
            if st and st["dialogs"] and any("Select Kernel" in d for d in st["dialogs"]):
                self.page.click(".jp-Dialog .jp-mod-accept")
            elif st and st["status"] == "idle" and st["cells"]:
                pythons = {argv[0] for argv in self.lab.kernels().values()}
                assert pythons == {str(VENV_PY)} or not Path("/proc/self").exists(), (
                    f"{self.rel}: the kernel runs {sorted(pythons)}, not the project's {VENV_PY}")
                return st
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.rel}: the notebook's kernel did not start within {limit:.0f} s "
                    f"(kernel status {st and st['status']!r}, dialogs {st and st['dialogs']});\n"
                    f"server log:\n{self.lab.log_tail()}{self.console_tail()}")
            time.sleep(0.5)

    def run_all(self, timeout: float = NB_TIMEOUT) -> dict:
        """Run -> Run All Cells, then wait until the kernel is idle and no cell is queued.

        The limit is `timeout` stretched by the highest load seen while the notebook runs."""
        self.page.get_by_role("menuitem", name="Run", exact=True).click()
        self.page.click('li.lm-Menu-item[data-command="runmenu:run-all"]')
        t0 = time.monotonic()
        started, quiet, stretch = False, 0, load_stretch()
        while True:
            time.sleep(1.0)
            stretch = max(stretch, load_stretch())
            st = self.state()
            code = [c for c in st["cells"] if c["type"] == "code"]
            pending = any(c["prompt"].startswith("[*]") for c in code)
            started = started or pending or any(c["count"] is not None for c in code)
            if st["dialogs"]:
                raise AssertionError(f"{self.rel}: JupyterLab shows a dialog while running: "
                                     f"{st['dialogs'][0][:300]!r}{self.console_tail()}")
            if started and not pending and st["status"] == "idle":
                quiet += 1
                loading = any("Loading widget" in o["text"] for c in code for o in c["outputs"])
                if quiet >= 2 and (not loading or quiet >= 30):  # let widget views attach
                    st["seconds"] = time.monotonic() - t0
                    return st
            else:
                quiet = 0
            if not started and time.monotonic() - t0 > 60 * stretch:
                raise AssertionError(f"{self.rel}: Run All Cells did not start any cell in "
                                     f"{60 * stretch:.0f} s "
                                     f"(kernel {st['status']}){self.console_tail()}")
            if st["status"] in ("dead", "unknown", "no kernel") and started:
                raise AssertionError(f"{self.rel}: the kernel died while running "
                                     f"(status {st['status']}){self.console_tail()}")
            if time.monotonic() - t0 > timeout * stretch:
                running = [c for c in code if c["prompt"].startswith("[*]")]
                where = f"cell {running[0]['index'] + 1} ({running[0]['head']!r})" if running else "?"
                said = running[0]["outputs"][-1]["tail"][-300:] if running and \
                    running[0]["outputs"] else ""
                raise AssertionError(
                    f"{self.rel}: still running after {time.monotonic() - t0:.0f} s (limit "
                    f"{timeout:.0f} s x {stretch:.1f} for the machine's load), at {where}; "
                    f"{kernel_activity(self.lab, st['status'])}"
                    + (f"; the cell's last output: {said!r}" if said else "")
                    + ". Set MINISGL_BROWSER_TIMEOUT (seconds on an unloaded machine) to allow "
                    "longer.")

    def output(self, i: int, k: int):
        tag = f"o{i}-{k}"
        self.page.evaluate(TAG_JS, [self.rel, i, k, tag])
        return self.page.locator(f'[data-browser-test="{tag}"]')


def _code(path: Path) -> str:
    """All code cells' source of a notebook file."""
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                     for c in cells if c["cell_type"] == "code")


def _where(rel: str, cell: dict) -> str:
    return f"{rel}, cell {cell['index'] + 1} ({cell['head']!r})"


def _first_error(st: dict):
    for cell in st["cells"]:
        for out in cell["outputs"]:
            if out["type"] == "error":
                return cell, out
    return None, None


def rendering_problems(nb: Notebook, st: dict) -> list[str]:
    """What is missing from the page: widgets shown as text, figures that did not display."""
    problems = []
    for cell in st["cells"]:
        for out in cell["outputs"]:
            where = _where(nb.rel, cell)
            text = out["text"].strip()
            if WIDGET_MIME in out["mimes"]:
                if out["domMime"] == "text/plain" or not out["widgets"]:
                    problems.append(
                        f"{where}: the widget did not render; the page shows its text fallback "
                        f"{text[:120]!r} (rendered as {out['domMime']!r}) instead of live widget "
                        "views: JupyterLab has no working ipywidgets front end "
                        "(jupyterlab_widgets missing or not matching ipywidgets)")
                    continue
                bad = [f for f in WIDGET_FALLBACKS if f in text]
                if bad:
                    problems.append(f"{where}: the widget shows {bad[0]!r}: {text[:200]!r}")
            elif out["type"] in ("display_data", "execute_result") and WIDGET_REPR.match(text):
                problems.append(f"{where}: a widget shows as its text repr {text[:120]!r}")
            if any(m in out["mimes"] for m in ("image/png", "image/jpeg")) and not any(
                    im["ok"] for im in out["imgs"]):
                problems.append(f"{where}: a figure output did not display as an image "
                                f"(rendered as {out['domMime']!r}: {text[:120]!r})")
            if "image/svg+xml" in out["mimes"] and not out["svgs"]:
                problems.append(f"{where}: an SVG output did not display")
            if out["type"] in ("display_data", "execute_result") and FIGURE_REPR.match(text) and \
                    not out["imgs"]:
                problems.append(f"{where}: a figure shows only as {text!r}: it was never drawn "
                                "(inline backend not active?)")
            if WIDGET_MIME in out["mimes"] and out["imgs"] and not all(im["ok"] for im in out["imgs"]):
                problems.append(f"{where}: an image inside the widget did not load")
    return problems


IMG_SRCS_JS = "node => Array.from(node.querySelectorAll('img')).map(im => im.src)"


def check_slider_redraws(nb: Notebook, cell: dict, k: int) -> str | None:
    """Move the widget's first slider one step with the keyboard; the picture must change."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    out = nb.output(cell["index"], k)
    handle = out.locator(".noUi-handle").first
    if handle.count() == 0:
        return None  # a widget without a slider (e.g. a progress bar): nothing to move
    before = out.evaluate(IMG_SRCS_JS)
    if not before:
        return f"{_where(nb.rel, cell)}: the slider's widget draws no picture (no <img> in it)"
    handle.scroll_into_view_if_needed()
    now, top = handle.get_attribute("aria-valuenow"), handle.get_attribute("aria-valuemax")
    key = "ArrowLeft" if now is not None and top is not None and float(now) >= float(top) else "ArrowRight"
    handle.focus()
    handle.press(key)
    limit = 90 * load_stretch()
    try:
        nb.page.wait_for_function(
            """([tag, before]) => {
                 const node = document.querySelector(`[data-browser-test="${tag}"]`);
                 const srcs = Array.from(node.querySelectorAll('img')).map(im => im.src);
                 return srcs.length > 0 && JSON.stringify(srcs) !== JSON.stringify(before)
                        && Array.from(node.querySelectorAll('img')).every(im => im.complete);
               }""", arg=[f"o{cell['index']}-{k}", before], timeout=limit * 1000, polling=500)
    except PlaywrightTimeout:
        after = handle.get_attribute("aria-valuenow")
        return (f"{_where(nb.rel, cell)}: moving the slider ({key}: {now} -> {after}) did not "
                f"change the picture within {limit:.0f} s{nb.console_tail()}")
    return None


def _screenshot(nb: Notebook, cell: dict, k: int, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    out = nb.output(cell["index"], k)
    out.scroll_into_view_if_needed()
    out.screenshot(path=str(SCREENSHOTS / f"{name}.png"))


@pytest.fixture
def notebook(lab, browser):
    opened = []

    def open_(rel: str) -> Notebook:
        restore_package(lab)
        nb = Notebook(lab, browser, rel)
        opened.append(nb)
        return nb

    yield open_
    for nb in opened:
        nb.close()


# ---------------------------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize("stem", _notebooks("solutions"))
def test_solution_notebook_in_jupyterlab(notebook, stem):
    rel = f"solutions/{stem}.ipynb"
    nb = notebook(rel)
    opened = nb.open()
    assert opened["kernelName"] == "python3", f"{rel} started kernel {opened['kernelName']!r}"
    st = nb.run_all()
    print(f"{rel}: ran in {st['seconds']:.0f} s")

    cell, err = _first_error(st)
    assert err is None, (f"{_where(rel, cell)} raised {err['ename']}: {err['evalue']}\n"
                         f"{err['tail']}")
    code = [c for c in st["cells"] if c["type"] == "code"]
    unrun = [c for c in code if c["count"] is None]
    assert not unrun, f"{_where(rel, unrun[0])} never ran (no execution count)"

    problems = rendering_problems(nb, st)
    assert not problems, "\n".join(problems) + nb.console_tail()

    widgets = [(c, k) for c in code for k, o in enumerate(c["outputs"]) if WIDGET_MIME in o["mimes"]]
    images = [(c, k) for c in code for k, o in enumerate(c["outputs"])
              if any(im["ok"] for im in o["imgs"]) or o["svgs"]]  # figures, and widgets drawing one
    sources = _code(ROOT / rel)
    if "ipywidgets" in sources:
        assert widgets, f"{rel} imports ipywidgets but no cell displayed a widget"
    if "plt.show()" in sources or "matplotlib" in sources:
        assert images, f"{rel} uses matplotlib but no figure appeared in the page"
    if images:
        _screenshot(nb, *images[0], stem)

    problems = [p for c, k in widgets if (p := check_slider_redraws(nb, c, k))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("stem", _notebooks("notebooks"))
def test_learner_notebook_in_jupyterlab(notebook, stem):
    rel = f"workspace/notebooks/{stem}.ipynb"  # the learner's own copy, as `make lab` makes it
    nb = notebook(rel)
    opened = nb.open()
    assert opened["kernelName"] == "python3", f"{rel} started kernel {opened['kernelName']!r}"
    st = nb.run_all()
    print(f"{rel}: ran in {st['seconds']:.0f} s")
    code = [c for c in st["cells"] if c["type"] == "code"]
    cell, err = _first_error(st)
    if err is None:
        unrun = [c for c in code if c["count"] is None]
        assert not unrun, f"{_where(rel, unrun[0])} never ran, and no cell shows an error"
    else:
        shown = f"{err['ename']}: {err['evalue']}"
        # the stub itself, or a check cell reporting it ("Exercise 0.1: rms_norm raised
        # NotImplementedError: Exercise 0.1: ..."): either way the stub's own message is shown
        stubs = [json.loads(m) for m in re.findall(r'raise NotImplementedError\(("(?:[^"\\]|\\.)*")\)',
                                                   _code(ROOT / "notebooks" / f"{stem}.ipynb"))]
        quoted = [m for m in stubs if m in (err["evalue"] or "")]
        assert err["ename"] in ("NotImplementedError", "AssertionError") and quoted, (
            f"the first error a learner sees in {rel} is not an exercise stub: "
            f"{_where(rel, cell)} raised {shown}\n{err['tail']}")
        match = STUB.match(quoted[0])
        assert match and int(match.group(1)) == int(stem[:2]), (
            f"{_where(rel, cell)}: the first error names another chapter's exercise: {shown}")
        assert err["ename"] == "NotImplementedError" or "NotImplementedError" in err["evalue"], (
            f"{_where(rel, cell)}: a check cell reports the stub {quoted[0]!r} without saying it "
            f"is not written yet: {shown}")
        assert shown in err["tail"], (
            f"{_where(rel, cell)}: the page does not show the message {shown!r}: {err['tail']!r}")
        before = [c for c in code if c["index"] < cell["index"] and c["count"] is None]
        assert not before, f"{_where(rel, before[0])} never ran before the first error"
        print(f"stops first at {_where(rel, cell)}: {shown}")
    problems = rendering_problems(nb, st)
    assert not problems, "\n".join(problems) + nb.console_tail()
