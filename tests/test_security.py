"""Security basics: weights only from safetensors, no remote code, no network.

(Committed notebooks holding no outputs is checked by `tools/workbook.py check`, through
`nbstripout --verify`.)"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import pytest

from helpers import ROOT

PACKAGE_FILES = sorted((ROOT / "minisgl").rglob("*.py"))
OUR_CODE = PACKAGE_FILES + sorted((ROOT / "examples").rglob("*.py")) + \
    sorted((ROOT / "tools").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))


def test_no_pickle_loading_in_the_package():
    """torch.load / pickle can run code hidden in a checkpoint; the package reads safetensors."""
    pattern = re.compile(r"\b(torch\.load|pickle\.loads?|import pickle|from pickle)\b")
    for path in PACKAGE_FILES:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{path.relative_to(ROOT)}:{i}: {line.strip()}"


def test_no_trust_remote_code():
    for path in OUR_CODE + sorted((ROOT / "solutions").glob("*.ipynb")):
        text = path.read_text()
        assert "trust_remote_code=True" not in text, f"{path.relative_to(ROOT)} trusts remote code"


def test_weights_are_read_only_from_safetensors():
    from minisgl.models import weight

    assert "safe_open" in (ROOT / "minisgl" / "models" / "weight.py").read_text()
    # a folder holding only a pickle checkpoint is refused, not loaded
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        (Path(tmp) / "pytorch_model.bin").write_bytes(b"not really a pickle")
        with pytest.raises(FileNotFoundError, match="safetensors"):
            weight.safetensors_files(Path(tmp))


def test_the_network_is_closed_during_tests():
    """pytest-socket (options in pyproject.toml) makes any non-loopback connection fail, as a hub
    call would; loopback stays open (JupyterLab in the browser test, torch.distributed)."""
    from pytest_socket import SocketConnectBlockedError

    with pytest.raises(SocketConnectBlockedError, match="203.0.113.1"), pytest.warns(UserWarning):
        socket.create_connection(("203.0.113.1", 443), timeout=1)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        socket.create_connection(server.getsockname(), timeout=5).close()


def test_hub_is_offline_during_tests():
    import os

    assert os.environ.get("HF_HUB_OFFLINE") == "1"


def test_a_blocked_connection_says_why(tmp_path):
    """The options in pyproject.toml reach every pytest run from the root, and a test that
    tries to download fails with a note on the offline rule (tests/conftest.py)."""
    for rel in ("pyproject.toml", "tests/conftest.py"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text())
    (tmp_path / "tests" / "test_download.py").write_text(
        "import urllib.request\n\n\ndef test_download():\n"
        "    urllib.request.urlopen('http://203.0.113.1/model.safetensors', timeout=1)\n")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                         cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "SocketConnectBlockedError" in res.stdout and "make models" in res.stdout, res.stdout
