"""A spawned rank of ``cpslice verify``: it joins the parent's store and one gloo
group, initializes megatron-core's ``parallel_state``, runs every case's check in
order and sends the parent one ``Report`` per case through a queue (or its failure,
with the traceback). Only the ranks import megatron-core.
"""

import multiprocessing.queues
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

from .cases import Config
from .check import Errors, check_case


class Report(NamedTuple):
    """One rank's message to the parent: ready to start, a case's errors, or its failure."""

    rank: int
    cp_rank: int
    case: int  # index into Config.cases; -1 before the first case
    errors: Errors | None  # None when ready, or with a failure
    empty: tuple[bool, ...]  # per batch: this rank held no response
    failure: str | None  # the rank's traceback


if TYPE_CHECKING:
    Outbox = multiprocessing.queues.Queue[Report]
else:
    Outbox = multiprocessing.queues.Queue

RankMain = Callable[[int, int, Config, Outbox], None]
"""A spawned rank's entry: ``(rank, store port, config, outbox)``; ``rank_main``."""


def join_store(port: int) -> TCPStore:
    """A client of the store the parent serves on ``port`` (``runner.host_store``);
    pass it to ``torch.distributed.init_process_group(store=...)``."""
    return TCPStore("127.0.0.1", port, is_master=False)


def rank_main(rank: int, port: int, config: Config, out: Outbox) -> None:
    """A spawned rank: gloo, megatron-core's parallel_state, then every case in order.

    A failure is sent to the parent first and cleaned up after: the parent kills the
    ranks still waiting in a collective for this one.
    """
    # Ctrl-C reaches the whole process group: the parent alone handles it (and kills
    # us). The parent spawned us with SIGINT ignored already, so that a Ctrl-C while
    # we import torch prints nothing either; this keeps it so.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world))
    if config.compile:
        from .._vocab.backends import selection as backend

        backend.selected.name = "compiled"  # CPSLICE_BACKEND=compiled for this process
    where = {"case": -1, "cp_rank": -1}
    try:
        dist.init_process_group(
            "gloo", store=join_store(port), rank=rank, world_size=config.world
        )
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(
            tensor_model_parallel_size=config.tp_size, context_parallel_size=config.cp_size
        )
        cp_rank = where["cp_rank"] = ps.get_context_parallel_rank()
        tp_rank = ps.get_tensor_model_parallel_rank()
        tp_group = ps.get_tensor_model_parallel_group()
        cp_group = ps.get_context_parallel_group()
        out.put(Report(rank, cp_rank, -1, None, (), None))
        for case, c in enumerate(config.cases):
            where["case"] = case
            errors, empty = check_case(c, config, tp_rank, tp_group, cp_group)
            out.put(Report(rank, cp_rank, case, errors, empty, None))
    except Exception:  # noqa: BLE001 - sent to the parent, which reports it
        out.put(Report(rank, where["cp_rank"], where["case"], None, (), traceback.format_exc()))
    finally:
        shut_down()


def shut_down() -> None:
    """Leave megatron-core's parallel_state and the gloo group, whatever was set up."""
    if "megatron.core.parallel_state" in sys.modules:  # never import it just to leave
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
