"""The process group of a run's processes, one per attempt under torchrun's restarts.

torchrun's elastic agent restarts the whole worker group when a worker dies (``--max-restarts``). With the agent's
store (``TORCHELASTIC_USE_AGENT_STORE=True``: the agent hosts the TCPStore that ``env://`` connects to, and it
outlives the workers), the keys the dead attempt's ranks wrote (gloo's and NCCL's addresses, barriers' counters)
are still there when the next attempt's ranks meet: a rank that reads its peer's address from the previous attempt
connects to a dead socket (measured: gloo's ``connectFullMesh`` refused, then a group that never forms). So under
torchrun each attempt meets under its own prefix of the store (``alignopsd/attempt_<TORCHELASTIC_RESTART_COUNT>``);
outside torchrun, or with rank 0 hosting a new store every attempt, ``env://`` as usual. The restart count is read
here only (:func:`restart_count`; the run's attempt records in engine/run/restarts.py read it from here).

A node whose agent dies and is started again (a node that rebooted, or that the scheduler replaced) needs the
latter: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in every agent's environment. With the shared store (torch 2.13),
the surviving agent, rank 0 of the rendezvous, publishes the workers' address once, so the new agent waits for it
until its rendezvous times out (measured: tests/engine/test_two_nodes.py); and the new agent's workers count no
restart while the survivors' count one, so their prefixes would differ too.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

STORE_TIMEOUT = timedelta(minutes=10)  # how long a rank waits for its peers to reach the store
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # torchrun's count of the restarts of its worker group


def restart_count() -> int | None:
    """This attempt's place in its launch: torchrun's restart count (0 on a new launch, and where the count does not
    read as a number), None outside torchrun."""
    raw = os.environ.get(RESTART_COUNT)
    if raw is None:
        return None
    try:
        return max(0, int(raw))
    except ValueError:
        return 0


def start_process_group(device_kind: str) -> None:
    """The process group of processes on ``device_kind`` devices ("cuda", "cpu"), from torchrun's environment: NCCL
    on CUDA, gloo elsewhere (the one place that choice is made); under this attempt's own store prefix when the
    agent's store outlives the attempts."""
    backend = "nccl" if device_kind == "cuda" else "gloo"
    restart = restart_count()
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=STORE_TIMEOUT
    )
    dist.init_process_group(
        backend=backend, store=dist.PrefixStore(f"alignopsd/attempt_{restart}", store), rank=rank, world_size=world
    )
