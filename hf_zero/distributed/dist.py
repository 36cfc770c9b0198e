"""Process groups, device and backend choice, and rank helpers.

One rule drives this file: the device and the backend come from the environment, so the
same training code runs on NCCL with one process per GPU and on gloo with CPU processes
(which is how the test suite exercises every distributed algorithm).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import re
import socket
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from hf_zero.errors import PeerFailureError
from hf_zero.training import preemption


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def local_rank() -> int:
    """The process's rank on its node, as torchrun (and DeepSpeed's launcher) export it."""
    return _env_int("LOCAL_RANK", 0)


def get_device() -> torch.device:
    """The device this process trains on: its local GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def default_backend() -> str:
    """NCCL when GPUs are present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: object | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise ``torch.distributed`` once, as ``deepspeed.init_distributed`` does.

    Under torchrun (or ``hf-zero launch``) the rendezvous variables are in the environment.
    A plain ``python train.py`` has none of them; it then becomes a world of one, created
    over an in-memory store so that no port is opened. Calling this twice is harmless.
    ``auto_mpi_discovery``, ``distributed_port``, ``verbose`` and ``config`` are accepted
    for signature compatibility with DeepSpeed.

    ``timeout`` bounds how long a collective waits for a rank that stopped answering (hung, or
    on NCCL, dead) before every other rank raises; without it, ``HF_ZERO_COMM_TIMEOUT``
    (seconds) applies when set, else torch's default (30 minutes on gloo, 10 on NCCL).
    """
    del auto_mpi_discovery, distributed_port, verbose, config, dist_init_required
    if dist.is_initialized():
        # Made by someone else (Accelerate's PartialState, for the Trainer): a gloo group still must
        # not be left to interpreter teardown, which can abort a rank of a finished run (see below;
        # seen in 1 of 3 fresh-clone CI runs, on the Trainer push test of tests/test_hub.py).
        if dist.get_backend() == "gloo":
            _destroy_at_exit_once()
        return
    backend = dist_backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError(
            "init_distributed(dist_backend='nccl'): NCCL needs CUDA GPUs and none is visible here; leave "
            "dist_backend unset (gloo without GPUs) or pass get_accelerator().communication_backend_name()"
        )
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(get_device())
    kwargs: dict = {}
    timeout = timeout if timeout is not None else comm_timeout()
    if timeout is not None:
        kwargs["timeout"] = timeout
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    # A process group still alive at interpreter exit can abort the process ("terminate called
    # without an active exception") once gloo's worker threads are torn down in arbitrary order;
    # tutorial scripts never destroy it, so the group hf_zero created is destroyed at exit.
    _destroy_at_exit_once()
    if init_method is None and launched and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, store=_attempt_store(kwargs.get("timeout")), rank=_env_int("RANK", 0),
                                world_size=_env_int("WORLD_SIZE", 1), **kwargs)
        return
    if init_method is not None or launched:
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            rank=rank if rank >= 0 else _env_int("RANK", 0),
            world_size=world_size if world_size >= 0 else _env_int("WORLD_SIZE", 1),
            **kwargs,
        )
        return
    if world_size not in (-1, 1):
        raise RuntimeError(
            f"init_distributed: world_size={world_size} was asked for but no launcher variables "
            "(RANK, WORLD_SIZE, MASTER_ADDR) are set; start the script with `hf-zero launch` or torchrun."
        )
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


TIMEOUT_ENV = "HF_ZERO_COMM_TIMEOUT"


def comm_timeout() -> datetime.timedelta | None:
    """The collective timeout ``HF_ZERO_COMM_TIMEOUT`` asks for (seconds, > 0), or None when unset."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}: got {text!r}, expected a number of seconds > 0")
    return datetime.timedelta(seconds=seconds)


def _attempt_store(timeout: datetime.timedelta | None) -> dist.Store:
    """torchrun's agent store, with keys of this restart attempt only.

    With torchrun's static rendezvous (``--master-addr/--master-port``, which ``hf-zero launch``
    uses) the agent keeps one store across ``--max_restarts`` attempts and torch's ``env://``
    does not prefix it, so a restarted rank can read the gloo/NCCL address its dead predecessor
    published and fail to connect ("Gloo connectFullMesh failed ... Connection refused"). Keys
    under ``hf_zero/attempt_<TORCHELASTIC_RESTART_COUNT>`` belong to one attempt.
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), _env_int("WORLD_SIZE", 1), is_master=False,
        timeout=timeout or datetime.timedelta(minutes=30),
    )
    return dist.PrefixStore(f"hf_zero/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


_failed = False


def _watch_uncaught_exceptions() -> None:
    """Remember whether the script dies of an exception, so the exit barrier is skipped then."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        global _failed
        _failed = True
        previous(exc_type, exc, tb)
        preemption.release()  # a dying script saves nothing: SIGTERM stops it as before

    sys.excepthook = hook


_exit_registered = False


def _destroy_at_exit_once() -> None:
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_destroy_at_exit)
        _watch_uncaught_exceptions()


def _destroy_at_exit() -> None:
    """Leave together on a clean exit: wait (bounded) for every rank, then destroy the group."""
    if dist.is_initialized():
        try:
            if not _failed and dist.get_backend() == "gloo" and dist.get_world_size() > 1:
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
            dist.destroy_process_group()
        except Exception:  # the interpreter is exiting; never turn a clean exit into a failure
            pass


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def gather_ints(values: list[int], group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """Every rank's ``values`` (same length on each), as a list indexed by rank; no pickle involved."""
    world = get_world_size(group)
    if world == 1:
        return [list(values)]
    device = get_device() if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [t.tolist() for t in out]


def gather_json(obj: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj`` (anything JSON can hold), indexed by rank: JSON bytes in tensors, never pickle."""
    import json

    if get_world_size(group) == 1:
        return [obj]
    data = json.dumps(obj).encode()
    sizes = [n for (n,) in gather_ints([len(data)], group)]
    device = get_device() if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.empty_like(mine) for _ in sizes]
    dist.all_gather(out, mine, group=group)
    return [json.loads(bytes(t[:n].cpu().tolist()).decode()) for t, n in zip(out, sizes)]


# ------------------------------------------------------------------ a rank that dies or hangs
#
# When a peer process dies, gloo's next collective on every other rank fails with a socket error
# ("Connection closed by peer [10.0.0.2]:41237") that names an address, not a rank; when a peer
# hangs, the collective fails after the process group's timeout. Neither says which rank to look
# at. So every engine writes "host pid" for its rank into the process group's store when it is
# built, and when a collective fails the survivors look their peers up there: a peer on the same
# host whose process is gone (or a zombie) is named as dead. The store is torchrun's agent store
# (or the test's FileStore), which outlives the ranks.

_COMM_FAILURE = re.compile(
    r"connection (closed|reset|refused)|closed by peer|broken pipe|timed out|read error|write error|"
    r"unhandled system error|remote process exited",
    re.I,
)
_registered: set[int] = set()


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _key(rank: int) -> str:
    return f"hf_zero/proc/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def register_process() -> None:
    """Record this rank's host and pid in the store, so survivors can tell which rank died."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    store = _store()
    if store is None or id(store) in _registered:
        return
    try:
        store.set(_key(rank), f"{socket.gethostname()} {os.getpid()}")
        _registered.add(id(store))
    except Exception:  # diagnostics only; never fail a run over them
        pass


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs; a zombie (killed, not yet reaped by torchrun) counts as gone."""
    if not os.path.isdir("/proc/self"):  # no procfs (macOS): signal 0 tells existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def dead_ranks() -> list[tuple[int, int]]:
    """``(rank, pid)`` of the peers on this host whose process is gone, from the store's records."""
    store, host = _store(), socket.gethostname()
    if store is None or not dist.is_initialized():
        return []
    dead = []
    for r in range(dist.get_world_size()):
        if r == dist.get_rank():
            continue
        try:
            if not store.check([_key(r)]):
                continue
            peer_host, pid = store.get(_key(r)).decode().split()
        except Exception:
            continue
        if peer_host == host and not _alive(int(pid)):
            dead.append((r, int(pid)))
    return dead


DYING_GRACE_S = 1.0  # how long a peer whose connection just closed may take to show up as dead
LAUNCHER_GRACE_S = 2.0  # how long a survivor under torchrun waits to be stopped by the agent


def _dead_ranks_settled(text: str) -> list[tuple[int, int]]:
    """:func:`dead_ranks`, looking again for up to :data:`DYING_GRACE_S` when a connection was just closed.

    A SIGKILLed process closes its sockets while it is torn down and becomes a zombie only after,
    so the survivor's read error can arrive while the peer still looks alive for a few milliseconds.
    """
    dead = dead_ranks()
    if dead or not re.search(r"closed|reset|broken pipe|remote process exited", text, re.I):
        return dead
    deadline = time.monotonic() + DYING_GRACE_S
    while not dead and time.monotonic() < deadline:
        time.sleep(0.05)
        dead = dead_ranks()
    return dead


def _describe(error: BaseException, doing: str) -> tuple[str | None, bool]:
    """The sentence for a collective that failed because of another rank (None if not that), and whether a peer died."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None, False
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if not isinstance(error, dist.DistError) and not _COMM_FAILURE.search(text):
        return None, False
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = comm_timeout()
    limit = f"{timeout.total_seconds():g} s ({TIMEOUT_ENV})" if timeout is not None else "the process group's timeout"
    dead = _dead_ranks_settled(text)
    if dead:
        names = ", ".join(f"rank {r} (pid {pid})" for r, pid in dead)
        verb = "has" if len(dead) == 1 else "have"
        return (
            f"{names} {verb} died, so rank {rank} stops in {doing} instead of waiting for it; "
            "restart from the last checkpoint (hf-zero launch --max_restarts N does it automatically)"
        ), True
    others = [r for r in range(world) if r != rank]
    who = f"rank {others[0]}" if len(others) == 1 else "another rank"
    if re.search(r"timed out|timeout", text, re.I):
        return (
            f"{who} did not answer within {limit}, so rank {rank} stops in {doing}; "
            f"it is hung or far behind (gloo/NCCL said: {text[:200]})"
        ), False
    return (
        f"rank {rank} lost its connection to {who} in {doing}, which usually means that rank died "
        f"(torchrun's summary names the rank that failed first; the backend said: {text[:200]})"
    ), False


def describe_peer_failure(error: BaseException, doing: str) -> str | None:
    """One sentence for a collective that failed because of another rank; None if it was not that."""
    return _describe(error, doing)[0]


def _let_the_launcher_see_it_first(sentence: str) -> None:
    """Under torchrun, say ``sentence`` now and give the agent a moment to stop this survivor itself.

    torchrun's summary calls the failure with the smallest timestamp the root cause; a process that
    left no error file is stamped with the second the agent noticed it, and a tie goes to the lowest
    rank. A survivor that exits in the same poll (0.1 s) as the rank that died would be blamed
    instead of it. Waiting lets the agent see the dead rank alone and stop this one with SIGTERM.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    print(f"[rank{get_rank()}]: hf_zero.errors.PeerFailureError: {sentence}", file=sys.stderr, flush=True)
    time.sleep(LAUNCHER_GRACE_S)


@contextlib.contextmanager
def peer_failure_guard(doing: str) -> Iterator[None]:
    """Turn a collective failure caused by another rank into one :class:`PeerFailureError` sentence."""
    try:
        yield
    except PeerFailureError:
        raise
    except RuntimeError as e:
        sentence, died = _describe(e, doing)
        if sentence is None:
            raise
        preemption.release()  # no rank can save with a peer gone: torchrun's SIGTERM must stop this one as before
        if died:
            _let_the_launcher_see_it_first(sentence)
        raise PeerFailureError(sentence) from None
