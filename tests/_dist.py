"""Real torch.distributed gloo process groups for tests: spawned processes, a store
the parent serves on a port it holds (no race for a free port), and a join timeout
so that a hang fails the test instead of blocking CI."""

import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from cpslice._verify.rank import join_store
from cpslice._verify.runner import host_store

Worker = Callable[..., Any]


def _child(
    fn: Worker, rank: int, world: int, port: int, args: tuple[Any, ...], out: Any
) -> None:
    try:
        dist.init_process_group("gloo", store=join_store(port), rank=rank, world_size=world)
        try:
            out.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure, the parent re-raises it
        out.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Worker, world: int, *args: Any, timeout: float = 90.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    Children run with ``CPSLICE_DEBUG=1``, so cpslice's run-time checks are on there
    too. A rank that fails re-raises here with its traceback; ranks that are still
    running after ``timeout`` seconds (a hang: a rank skipped a collective) are
    killed and the test fails.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = host_store()  # served from here until the ranks are done
    port = store.port
    old = os.environ.get("CPSLICE_DEBUG")
    os.environ["CPSLICE_DEBUG"] = "1"
    try:
        procs = [
            ctx.Process(target=_child, args=(fn, r, world, port, args, out), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
    finally:
        if old is None:
            del os.environ["CPSLICE_DEBUG"]
        else:
            os.environ["CPSLICE_DEBUG"] = old
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{world - len(results) - len(errors)} of {world} ranks did not finish "
                    f"within {timeout}s (a hang: some rank skipped a collective?)"
                )
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank died with exit code {dead[0].exitcode}") from None
                continue
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise AssertionError("\n".join(errors))
        for p in procs:
            p.join(timeout=10)
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def init_megatron(tp: int, cp: int) -> None:
    """megatron-core's parallel_state over the current gloo world (order tp-cp-...)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp
    )


def destroy_megatron() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


_TP_GROUPS: list[tuple[Any, int, int]] = []


def tp_groups(rank: int, world: int) -> list[tuple[Any, int, int]]:
    """``(group, tp size, rank in it)`` for the vocabulary-parallel workers: the whole
    world, then, in a world of 4, the two TP-2 subgroups ``[0, 1]`` and ``[2, 3]`` (the
    rank offset comes from the group rank). Made once per process: every worker of one
    spawn shares them (``new_group`` is collective and must be entered by all ranks)."""
    if not _TP_GROUPS:
        _TP_GROUPS.append((dist.group.WORLD, world, rank))
        if world == 4:
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            _TP_GROUPS.append((pairs[rank // 2], 2, rank % 2))
    return list(_TP_GROUPS)
