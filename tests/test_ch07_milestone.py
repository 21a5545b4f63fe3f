"""Chapter 07: the stage-1 milestone script, run as a learner would run it.

`examples/stage1_milestone.py` drives the Engine of chapters 01-06 by hand (one request, then four
in one batch) and compares every request's 16 greedy tokens with Hugging Face's `generate`: that
comparison, printed by the script, is the independent reference checked here. The test also
recomputes the number of KV pages written from the tokenizer, and checks every line's format.
It runs three times: as written (the default Engine: the learner's code, pages of one token),
with the one change ``page_size=4`` (the checkpoint's rerun: same tokens, fewer pages written),
and with the one change ``cpu_kernels=True`` (chapter 07's fused kernels, attention backend "cpp").
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # every test shares three runs of the milestone script
SCRIPT = ROOT / "examples" / "stage1_milestone.py"
PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):",
           "Once upon a time,"]
NEW_TOKENS = 16
EARLIER = ("01", "02", "03", "04", "05", "06")

ENGINE_LINE = {config: re.compile(rf"the real structure: cpu, attention backend {backend}, KV "
                                  r"pool 1024 pages, \d+ threads \(set by the Engine itself\)")
               for config, backend in (("default", "torch"), ("page_size4", "torch"),
                                       ("cpu_kernels", "cpp"))}
ENGINE_CONFIG_END = "max_seq_len_override=256))"  # the one change each variant makes to the script
CHANGES = {"page_size4": "max_seq_len_override=256, page_size=4))",
           "cpu_kernels": "max_seq_len_override=256, cpu_kernels=True))"}
PAGE_SIZE = {"default": 1, "page_size4": 4, "cpu_kernels": 1}
SINGLE_LINE = re.compile(r"single request: (['\"]).*\1")
TIMING_LINE = re.compile(r"  prefill \d+ ms, decode \d+ ms per step \(\d+\.\d tokens/s\)")
BATCH_LINE = re.compile(r"4 requests in one batch: prefill \d+ ms, decode \d+ ms per step "
                        r"\(4 tokens per step, \d+\.\d tokens/s in total; a step is only -?\d+% "
                        r"slower than a single request\)")
POOL_LINE = re.compile(r"KV pool: (\d+) / 1024 pages written; each token writes only its own "
                       r"page, no copies at all")
IDENTITY_PREFIX = "run alone or inside the 4-request batch, the first request's 16 tokens are " \
                  "identical: "


def model_dir() -> pathlib.Path:
    """The model the script uses: Qwen3-0.6B when prepared, else SmolLM2-135M-Instruct."""
    qwen = ROOT / "models" / "Qwen3-0.6B"
    path = qwen if qwen.is_dir() else ROOT / "models" / "SmolLM2-135M-Instruct"
    if not (path / "config.json").exists():
        pytest.fail(f"{path} is missing: run `make models` (or `python tools/prepare_models.py`)",
                    pytrace=False)
    return path


def quick_check() -> None:
    """Cheap: the milestone script exists and is valid Python."""
    if not SCRIPT.is_file():
        raise FileNotFoundError(f"{SCRIPT} is missing: restore it with `git checkout -- "
                                "examples/stage1_milestone.py`")
    compile(SCRIPT.read_text(encoding="utf-8"), str(SCRIPT), "exec")


@pytest.fixture(scope="module", autouse=True)
def earlier_chapters():
    from prereq import require

    ready = [nn for nn in EARLIER if any((ROOT / "tests").glob(f"test_ch{nn}_*.py"))]
    require(*ready)


@pytest.fixture(scope="module", params=["default", "page_size4", "cpu_kernels"])
def run(request, tmp_path_factory):
    """Run the script once per configuration: (process, stdout lines, a report on failure)."""
    quick_check()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    script = str(SCRIPT.relative_to(ROOT))
    if request.param in CHANGES:
        if request.param == "cpu_kernels":
            from helpers import require_kernels

            require_kernels()
        text = SCRIPT.read_text(encoding="utf-8")
        assert text.count(ENGINE_CONFIG_END) == 1, "the script's EngineConfig line changed"
        copy = tmp_path_factory.mktemp("milestone") / f"stage1_milestone_{request.param}.py"
        copy.write_text(text.replace(ENGINE_CONFIG_END, CHANGES[request.param]), encoding="utf-8")
        script = str(copy)
    try:
        proc = subprocess.run([sys.executable, script], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"examples/stage1_milestone.py ran for more than 300 s; partial output:\n"
                    f"{e.stdout or ''}\n{e.stderr or ''}", pytrace=False)
    report = (f"\n--- configuration: {request.param}\n--- exit code {proc.returncode}\n"
              f"--- stdout:\n{proc.stdout}\n"
              f"--- stderr (last 4000 characters):\n{proc.stderr[-4000:]}")
    return proc, proc.stdout.splitlines(), report, request.param


def test_script_exits_cleanly(run):
    proc, _, report, _ = run
    stub = re.search(r"NotImplementedError: (Exercise \d+\.\d+): (.*)", proc.stderr)
    if stub:
        pytest.fail(f"{stub[1]} is not done yet ({stub[2]}): the milestone script reached its "
                    "stub. Finish it in its chapter's notebook, then rerun." + report,
                    pytrace=False)
    assert proc.returncode == 0, (
        "examples/stage1_milestone.py failed; the traceback in stderr names the module "
        "(chapters 01-06) that breaks:" + report)


def test_engine_line(run):
    _, lines, report, config = run
    assert lines and ENGINE_LINE[config].fullmatch(lines[0]), (
        f"the first line should describe the Engine: CPU, the {'cpp' if config != 'default' else 'torch'} attention backend, a pool of "
        "1024 pages (num_page_override) and the thread count:" + report)


def test_single_request_lines(run):
    _, lines, report, config = run
    i = next((i for i, line in enumerate(lines) if line.startswith("single request:")), None)
    assert i is not None and SINGLE_LINE.fullmatch(lines[i]), (
        "missing or malformed 'single request: <text>' line:" + report)
    assert i + 1 < len(lines) and TIMING_LINE.fullmatch(lines[i + 1]), (
        "the line after the single request should be '  prefill N ms, decode N ms per step "
        "(X tokens/s)':" + report)


def test_batch_line(run):
    _, lines, report, config = run
    assert sum(bool(BATCH_LINE.fullmatch(line)) for line in lines) == 1, (
        "expected one '4 requests in one batch: ...' line in the script's format:" + report)


def test_pool_line_counts_the_pages_written(run):
    from transformers import AutoTokenizer

    _, lines, report, config = run
    found = [m for m in map(POOL_LINE.fullmatch, lines) if m]
    assert len(found) == 1, "expected one 'KV pool: N / 1024 pages written' line:" + report
    tok = AutoTokenizer.from_pretrained(model_dir())
    # each request writes its prompt, then the first 15 of its 16 new tokens as they are fed back,
    # into slots 256 r, 256 r + 1, ...: whole pages from the start of row r's range
    ps = PAGE_SIZE[config]
    tokens = [len(tok(p).input_ids) + NEW_TOKENS - 1 for p in PROMPTS]
    expected = sum(-(-n // ps) for n in tokens)
    assert int(found[0][1]) == expected, (
        f"the script reports {found[0][1]} pages written, but 4 requests writing {tokens} tokens "
        f"(prompt + 15 fed-back tokens) into pages of {ps} make {expected} pages:" + report)


def test_every_request_matches_hf(run):
    _, lines, report, config = run
    verdicts = [line for line in lines if "matches HF:" in line]
    assert len(verdicts) == len(PROMPTS), (
        f"expected {len(PROMPTS)} 'matches HF' lines, one per prompt, found {len(verdicts)}:"
        + report)
    wrong = [line.strip() for line in verdicts if not line.endswith("matches HF: True")]
    assert not wrong, (
        "these requests' 16 greedy tokens differ from Hugging Face's generate; a request that is "
        "right alone but wrong in the batch points at the page table, out_loc or the attention "
        "mask (chapters 04-05):\n  " + "\n  ".join(wrong) + report)


def test_alone_equals_batched(run):
    _, lines, report, config = run
    assert lines and lines[-1].startswith(IDENTITY_PREFIX), (
        "the last line should compare the first request alone and inside the batch:" + report)
    assert lines[-1] == IDENTITY_PREFIX + "True", (
        "the first request's tokens change when three other requests share its batch: its "
        "queries must only see its own keys (chapter 05's mask, chapter 04's page table):"
        + report)
