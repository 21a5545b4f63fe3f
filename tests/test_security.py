"""Security basics: weights only from safetensors, no remote code, no network, no outputs."""

from __future__ import annotations

import json
import re
import socket

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
    """tests/conftest.py makes any non-loopback connection fail (a hub call would)."""
    with pytest.raises(RuntimeError, match="offline"):
        socket.create_connection(("203.0.113.1", 443), timeout=1)


def test_hub_is_offline_during_tests():
    import os

    assert os.environ.get("HF_HUB_OFFLINE") == "1"


def test_committed_notebooks_hold_no_outputs():
    for path in sorted((ROOT / "solutions").glob("*.ipynb")) + \
            sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] == "code":
                assert not cell.get("outputs"), f"{path.name} cell {i} holds outputs"
                assert cell.get("execution_count") is None, f"{path.name} cell {i} has a count"
