"""Packaging: pinned dependencies, conda and pip agree, GPU-only packages stay optional, and
set-up installs only what the command needs (no browser outside `make test`)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest

from helpers import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(req: str) -> str:
    return re.split(r"[=<>!~\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_runtime_dependencies_are_pinned():
    deps = PYPROJECT["project"]["dependencies"]
    assert "torch==2.13.0" in deps, "torch must be pinned to 2.13.0 (an unpinned torch pulls a " \
        "multi-GB CUDA build)"
    for req in deps:
        if _name(req) == "numpy":
            continue
        assert "==" in req, f"{req!r} is not pinned with =="


def test_extras_exist_and_are_pinned():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"dev", "convert", "gpu"} <= set(extras)
    names = {_name(r) for r in extras["dev"]}
    for needed in ("jupyterlab", "ipywidgets", "matplotlib", "nbmake", "pytest", "nbformat",
                   "tqdm", "ruff", "nbstripout", "pytest-socket", "playwright"):
        assert needed in names, f"the dev extra lacks {needed}"
    assert {_name(r) for r in extras["convert"]} == {"gguf", "accelerate"}
    assert {_name(r) for r in extras["gpu"]} == {"flashinfer-python"}
    for req in extras["dev"] + extras["convert"]:
        assert "==" in req, f"{req!r} is not pinned with =="


def test_environment_yml_installs_the_package_through_pip():
    """conda and pip share one set of pins: environment.yml installs `-e .[dev,convert]` and
    pins nothing of its own that pyproject.toml also lists."""
    text = (ROOT / "environment.yml").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert "- -e .[dev,convert]" in lines, "environment.yml must pip-install -e .[dev,convert]"
    py = next(ln for ln in lines if ln.startswith("- python="))
    version = py.split("=", 1)[1]
    low, high = PYPROJECT["project"]["requires-python"].replace(">=", "").split(",<")
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(low) <= as_tuple(version) < as_tuple(high), \
        f"environment.yml's python={version} is outside pyproject's requires-python"
    project_names = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    for extra in PYPROJECT["project"]["optional-dependencies"].values():
        project_names |= {_name(r) for r in extra}
    conda_pkgs = {_name(ln[2:]) for ln in lines if ln.startswith("- ") and not ln.startswith("- -e")
                  and ":" not in ln}
    doubled = (conda_pkgs - {"python", "pip"}) & project_names
    assert not doubled, f"environment.yml pins {doubled} itself; let pyproject.toml pin them"


def test_package_never_imports_gpu_only_modules_at_import_time():
    """flashinfer is imported only inside the function that builds the 'fi' backend."""
    for path in (ROOT / "minisgl").rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"^(import|from)\s+flashinfer", line):
                raise AssertionError(f"{path}:{i} imports flashinfer at module level")


def test_default_model_loads_with_plain_transformers_and_knows_paris():
    """The prepared SmolLM2 folder is a plain safetensors checkpoint: `from_pretrained` with no
    GGUF, quantization config or remote code, and greedy decoding continues the classic prompt
    with " Paris." (what tools/prepare_models.py promises after converting the GGUF)."""
    import json

    from helpers import SMOL, hf_greedy, model_path, tokenizer

    path = model_path(SMOL)
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config, "the converted model kept its GGUF quantization"
    assert not list(path.glob("*.gguf")), "the model folder still holds the GGUF file"
    tok = tokenizer(SMOL)
    ids = tok("The capital of France is")["input_ids"]
    text = tok.decode(hf_greedy(SMOL, ids, 3))
    assert text.startswith(" Paris."), f"greedy continuation was {text!r}, expected ' Paris.'"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("target", ["setup", "models", "milestone", "lab", "test-quick", "test"])
def test_only_make_test_installs_a_browser(target):
    """`make -n` lists what a command would run: only `make test` (which runs the browser test)
    calls tools/install_browser.sh, and the set-up script itself installs no browser."""
    res = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=ROOT,
                         capture_output=True, text=True, check=False, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("install_browser.sh" in res.stdout) == (target == "test"), res.stdout
    code = [ln for ln in (ROOT / "tools" / "bootstrap.sh").read_text().splitlines()
            if not ln.lstrip().startswith("#")]
    assert not [ln for ln in code if "chromium" in ln.lower()], "bootstrap.sh installs a browser"
