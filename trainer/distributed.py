"""A training step on more than one process: `world_size` local ranks, DDP (issue 25).

The training worker that claimed the step calls `update` instead of `algorithm.update` when
the job's `world_size` is above 1. It starts `world_size` ranks with torch.multiprocessing
(spawn), each a fresh interpreter that joins one process group and runs the algorithm's own
`update` on its shard of the samples, the model wrapped in DistributedDataParallel (gradients
are all-reduced, so every rank takes the same optimizer step). Rank 0 alone hands the new state
back; the worker saves the checkpoint and finishes the step exactly as at world size 1.

Why torch.multiprocessing and not torchrun: the step runs inside a Celery worker process that
is already running (and, on the embedded default, inside `manage.py train`), not on a fresh
command line a launcher could own; the ranks are that process's children, started and joined
within the try, and their error is the try's error. The rendezvous is a FileStore in the try's
own temporary directory: no port to pick (a free port found, closed, then bound again by rank 0
races with any other process on the machine), nothing shared between two tries.

Backend: NCCL, one GPU per rank, when CUDA is available with at least `world_size` devices;
otherwise gloo on the CPU, each rank with its share of the CPU threads.

Inside `Algorithm.update`, `wrap`, `shard` and `world` are no-ops at world size 1, so an
algorithm written for one process runs unchanged there (bit for bit).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads with the first distributed step, not with this module
    import torch

    from trainer.algorithms.adapter import Sample
    from trainer.algorithms.base import Algorithm, Update

log = logging.getLogger(__name__)

DEFAULT_WORLD_SIZE = 1
MAX_WORLD_SIZE = 64


class RankFailed(RuntimeError):
    """A rank raised or died: the step's try fails with this (the rank's own error)."""


def world_size_of(config: dict[str, Any]) -> int:
    return int(config.get("world_size", DEFAULT_WORLD_SIZE))


def world_size_error(config: dict[str, Any], algorithm: Algorithm) -> str | None:
    """Why the job's `world_size` is not usable (one line), None when it is."""
    value = config.get("world_size", DEFAULT_WORLD_SIZE)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORLD_SIZE:
        return f"must be an integer from 1 to {MAX_WORLD_SIZE}, got {value!r}"
    if value > 1 and not algorithm.runs_ddp:
        return (f"{type(algorithm).__name__} trains in one process only; "
                f"world_size must be 1, got {value}")
    return None


MAX_NODES = 16


def nodes_of(config: dict[str, Any]) -> int:
    """Training workers that run one step together (a gang, trainer/gang.py); 1: one."""
    return int(config.get("nodes", 1))


def nodes_error(config: dict[str, Any]) -> str | None:
    """Why the job's `nodes` is not usable (one line), None when it is. `world_size` stays
    the number of ranks of the whole step (what the update's parity depends on), so it must
    divide evenly: each node runs world_size / nodes ranks."""
    value = config.get("nodes", 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NODES:
        return f"must be an integer from 1 to {MAX_NODES}, got {value!r}"
    world_size = config.get("world_size", DEFAULT_WORLD_SIZE)
    if value > 1 and world_size % value:
        return (f"world_size={world_size} must be a multiple of nodes={value} (each node runs "
                f"world_size / nodes ranks)")
    if value > 1 and config.get("parallel", "ddp") != "ddp":
        return ("a gang across nodes runs DDP only (FSDP's ranks write one checkpoint "
                "directory, which nodes do not share); parallel must be ddp")
    if (value > 1 and (config.get("max_staleness") or 0) > 0
            and config.get("consume", "groups") == "groups"):
        # Each member picks the groups itself (trainer/pool.py), reading the store at its own
        # moment: two members could train on different groups.
        return ("a gang across nodes trains on its step's own groups; with max_staleness, "
                "set consume: step")
    return None


# --- inside a rank (and no-ops in a single process) ------------------------------------------

PARALLEL = ("ddp", "fsdp")


def parallel_of(config: dict[str, Any]) -> str:
    return str(config.get("parallel", "ddp"))


def parallel_error(config: dict[str, Any], algorithm: Algorithm) -> str | None:
    """Why the job's `parallel` is not usable (one line), None when it is."""
    value = config.get("parallel", "ddp")
    if value not in PARALLEL:
        return f"must be one of {', '.join(PARALLEL)}, got {value!r}"
    if value == "fsdp" and not algorithm.runs_fsdp:
        return f"{type(algorithm).__name__} does not shard its parameters; parallel must be ddp"
    return None


# Set in a rank by _rank_main: how `wrap` distributes the model, and where an FSDP step's
# sharded checkpoint goes (torch.distributed.checkpoint; `save_sharded`).
_rank_setup: dict[str, str] = {}


def world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_bounds(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's contiguous slice [start, stop) of `count` items (sizes differ by <= 1)."""
    return count * rank // world_size, count * (rank + 1) // world_size


def sharded() -> bool:
    """This rank shards its parameters (FSDP2): job config `parallel: fsdp`, world size > 1."""
    return world()[1] > 1 and _rank_setup.get("parallel") == "fsdp"


def wrap(model: torch.nn.Module) -> torch.nn.Module:
    """`model` under DistributedDataParallel in a process group, or sharded in place with
    FSDP2's `fully_shard` (`parallel: fsdp`; its parameters become DTensors, so optimizers
    are made after this), else `model` itself."""
    rank, size = world()
    if size == 1:
        return model
    if sharded():
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                   else None)


def optimizer_load(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   state: dict[str, Any]) -> None:
    """Load a full optimizer state (torch's own, keyed by parameter index, or keyed by
    parameter name as a torch.distributed.checkpoint checkpoint holds it) into `optimizer`
    of `model`, sharded or not."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    if not state["state"]:
        # A fresh optimizer (checkpoint 0): nothing to load, its settings are the config's.
        # (set_optimizer_state_dict would first take a zero step to make the state, and
        # Adam's bias correction would then count one step too many.)
        return
    names = [name for name, _ in model.named_parameters()]
    if all(isinstance(p, int) for group in state["param_groups"] for p in group["params"]):
        if not sharded():
            optimizer.load_state_dict(state)
            return
        state = {"state": {names[i]: v for i, v in state["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                  for g in state["param_groups"]]}
    # A copy: the optimizer may keep the given tensors and update them in place, and a
    # loaded checkpoint's tensors are shared through trainer.checkpoints' cache.
    set_optimizer_state_dict(model, optimizer, optim_state_dict=copy.deepcopy(state),
                             options=StateDictOptions(full_state_dict=True))


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every rank writes its shards of the model and optimizer with
    torch.distributed.checkpoint into the try's checkpoint directory; the state to save:
    {"dcp": directory} (trainer/checkpoints.py stores and loads it at any world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state},
             checkpoint_id=_rank_setup["dcp"])
    return {"dcp": _rank_setup["dcp"]}


def all_sum(values: list[float], device: str | torch.device = "cpu") -> list[float]:
    """Sums of `values` over the ranks (the values themselves at world size 1)."""
    rank, size = world()
    if size == 1:
        return list(values)
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


# --- the worker's side ----------------------------------------------------------------------

def backend_for(world_size: int) -> str:
    import torch

    if torch.cuda.is_available() and world_size <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


@dataclass(frozen=True)
class Rendezvous:
    """How the ranks this process starts meet the others: `local` ranks from global rank
    `offset` of `world_size`, at a FileStore (`file`: all ranks on this machine) or at a
    TCPStore another process serves (`host`:`port`: a gang across nodes, trainer/gang.py)."""

    world_size: int
    local: int
    backend: str
    offset: int = 0
    file: str = ""
    host: str = ""
    port: int = 0
    timeout_seconds: float = 1800.0


def update(algorithm: Algorithm, *, step: int, state: dict[str, Any], samples: list[Sample],
           world_size: int, parallel: str = "ddp") -> tuple[Update, str]:
    """Run `algorithm.update` on `world_size` local ranks; rank 0's Update and the device
    label ("cpu x2", "cuda x2"). Raises RankFailed with the first failing rank's error; every
    rank is joined (or killed) before this returns or raises. With `parallel="fsdp"` the
    ranks write the new state with torch.distributed.checkpoint into a directory of its own
    that the Update names ({"dcp": directory}); the algorithm's `save` stores and removes it."""
    sharded_dir = tempfile.mkdtemp(prefix="lightning-dcp-") if parallel == "fsdp" else ""
    try:
        with tempfile.TemporaryDirectory(prefix="lightning-ddp-") as tmp:
            meet = Rendezvous(world_size=world_size, local=world_size,
                              backend=backend_for(world_size),
                              file=str(Path(tmp) / "rendezvous"))
            out = run_ranks(algorithm, meet, step=step, state=state, samples=samples,
                            setup={"parallel": parallel, "dcp": sharded_dir})
    except BaseException:
        if sharded_dir:
            shutil.rmtree(sharded_dir, ignore_errors=True)
        raise
    assert out is not None  # rank 0 is local
    device = "cuda" if meet.backend == "nccl" else "cpu"
    return out, f"{device} x{world_size}"


def run_ranks(algorithm: Algorithm, meet: Rendezvous, *, step: int, state: dict[str, Any],
              samples: list[Sample], setup: dict[str, str] | None = None,
              abort: Callable[[], str | None] | None = None) -> Update | None:
    """Start this process's `meet.local` ranks and join them: global rank 0's Update when it
    is one of them, else None. `abort` is asked every two seconds while they run; a reason
    from it kills them and raises RankFailed (a gang member lost elsewhere)."""
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    setup = setup or {"parallel": "ddp", "dcp": ""}
    threads = max(1, torch.get_num_threads() // meet.local)
    with tempfile.TemporaryDirectory(prefix="lightning-ranks-") as tmp:
        result = Path(tmp) / "rank0.pt"
        args = (meet, str(result), threads, os.getpid(), setup, algorithm, step, state,
                samples)
        with _children_allowed():
            context = mp.start_processes(_rank_main, args=args, nprocs=meet.local,
                                         join=False, start_method="spawn")
        try:
            while not context.join(timeout=2, grace_period=5):
                if abort is not None and (why := abort()) is not None:
                    raise RankFailed(why)
        except ProcessException as exc:
            # The others end on their own (a dead peer ends their collectives) or are killed
            # below; rank 0 may be saving a complete update.
            deadline = time.monotonic() + 10
            for process in context.processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
            if not result.exists():
                raise RankFailed(f"rank {meet.offset + exc.error_index} of {meet.world_size} "
                                 f"failed: {str(exc).strip()}") from None
            # Rank 0 saved the update after every collective of it had completed: a rank that
            # died after that (in its teardown) changed nothing of it.
            log.warning("rank %s of %s died after the update was complete (%s); using it",
                        meet.offset + exc.error_index, meet.world_size, str(exc).strip())
        finally:
            for process in context.processes:  # an interrupted join: no rank outlives the try
                if process.is_alive():
                    process.kill()
                process.join()
        if meet.offset != 0:
            return None
        return torch.load(result, weights_only=False)


_daemon_lock = threading.Lock()


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """A Celery prefork pool process is billiard's: marked daemonic, and multiprocessing
    refuses to start children from a daemonic process (so that none outlives it), and its
    authentication key is billiard's type, which multiprocessing's spawn cannot pickle. The
    ranks cannot outlive it: `update` joins or kills them before it returns, and each dies
    with its parent (`_die_with_parent`). So, while they start, the mark is lifted and the
    key (the same bytes) is multiprocessing's own; both are put back after."""
    from multiprocessing import process

    config = process.current_process()._config
    with _daemon_lock:
        saved = dict(config)
        config.pop("daemon", None)
        if "authkey" in config:
            config["authkey"] = process.AuthenticationString(bytes(config["authkey"]))
        try:
            yield
        finally:
            config.clear()
            config.update(saved)


def _rank_main(local_rank: int, meet: Rendezvous, result: str, threads: int, parent: int,
               setup: dict[str, str], algorithm: Algorithm, step: int, state: dict[str, Any],
               samples: list[Sample]) -> None:
    import torch
    import torch.distributed as dist

    _die_with_parent(parent)
    _rank_setup.update(setup)
    if os.environ.get("DJANGO_SETTINGS_MODULE"):
        # The worker is a Django process, and an algorithm's update may read settings or
        # import modules that need the app registry (grpo_lm's transformers quieting).
        import django

        django.setup()
    device = "cpu"
    if meet.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    else:
        torch.set_num_threads(threads)
    rank = meet.offset + local_rank
    timeout = timedelta(seconds=meet.timeout_seconds)
    if meet.file:
        store = dist.FileStore(meet.file, meet.world_size)
    else:  # a client of the TCPStore the gang's node 0 serves (trainer/gang.py)
        store = dist.TCPStore(meet.host, meet.port, meet.world_size, False, timeout=timeout)
    dist.init_process_group(meet.backend, store=store, rank=rank, world_size=meet.world_size,
                            timeout=timeout)
    out = algorithm.update(step=step, state=state, samples=samples, device=device)
    if rank == 0:
        torch.save(out, result + ".tmp")
        os.replace(result + ".tmp", result)
    # Every rank leaves together: one that tore its gloo pairs down while another was still
    # in its last collective aborted ("terminate called without an active exception", seen
    # once in CI on 2 loaded cores).
    dist.barrier()
    dist.destroy_process_group()


def _die_with_parent(parent: int) -> None:
    """Linux: this rank gets SIGKILL when the worker that started it dies (kill -9 of the
    worker leaves no rank behind); elsewhere a no-op. torch's spawn asks for SIGINT, which
    a rank blocked in a collective's C++ code does not act on."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def master_store(host: str, timeout_seconds: float) -> tuple[Any, int]:
    """A TCPStore server on `host` at a port the kernel picks (port 0: no race with another
    process over a port found free, closed and bound again); the store and its port. A gang's
    node 0 worker serves it while the try runs, and every rank of every node is its client."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=timeout_seconds),
                          wait_for_workers=False)
    return store, int(store.port)
