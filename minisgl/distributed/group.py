# Chapter 06 (06_engine_and_sampler.ipynb, optional tp section): the tp ranks' process group.
"""With ``tp_info.size > 1`` every rank's Engine joins one process group before it builds
anything: rank 0 opens the rendezvous store on a socket it bound to 127.0.0.1 itself (a
``TCPStore`` would otherwise listen on every interface), the other ranks connect to it, and
``init_process_group`` returns once all of them have joined (or raises after
``distributed_timeout`` seconds). gloo's and NCCL's own sockets stay on the loopback interface
too: nothing of a tp run is reachable from another machine.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


def loopback_host_port(addr: str) -> tuple[str, int]:
    """``tcp://127.0.0.1:PORT`` -> ("127.0.0.1", PORT); a clear error for any other address."""
    scheme, _, rest = addr.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or host not in _LOOPBACK_HOSTS or not port.isdigit() or not (
            0 < int(port) < 65536):
        raise ValueError(f"MINISGL_DIST_ADDR={addr!r}: the tp ranks meet on this machine only, at "
                         "tcp://127.0.0.1:PORT (they never listen on another interface); unset "
                         "it, or set it to e.g. tcp://127.0.0.1:29500.")
    return "127.0.0.1", int(port)


def _loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover
        names = []
    return next((n for n in names if n in ("lo", "lo0")), "lo")


def join_process_group(tp_info, addr: str, timeout_s: float, device: torch.device):
    """Join the group of the ``tp_info.size`` ranks (one Engine per process) at ``addr``; returns
    the group that carries CPU tensors (gloo). Whoever joined destroys it
    (``torch.distributed.destroy_process_group()``)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: an "
                           "Engine with tp > 1 creates its own process group; call "
                           "torch.distributed.destroy_process_group() first.")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    host, port = loopback_host_port(addr)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = _loopback_interface()
    timeout = datetime.timedelta(seconds=timeout_s)
    size = tp_info.size
    if tp_info.rank == 0:  # the store listens on 127.0.0.1, never on every interface
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(max(64, size))
        except OSError as e:
            listener.close()
            raise RuntimeError(f"rank 0 cannot listen on {host}:{port} ({e}): set "
                               "MINISGL_DIST_ADDR to a free port, e.g. "
                               "tcp://127.0.0.1:29500.") from e
        store = dist.TCPStore(host, port, size, True, timeout,
                              master_listen_fd=listener.detach())  # the store owns it now
    else:
        store = dist.TCPStore(host, port, size, False, timeout)
    dist.init_process_group(backend, store=store, rank=tp_info.rank, world_size=size,
                            timeout=timeout)
    return dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
