"""Layout.from_parallel_state on real gloo groups with megatron-core's parallel_state."""

import pytest

from ._dist import destroy_megatron, init_megatron, run_distributed

Got = list[tuple[str, int, int]]


def _worker(rank: int, world: int, shapes: list[tuple[int, int]]) -> tuple[str, list[Got]]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from cpslice import Layout

    try:
        Layout.from_parallel_state([10], [4])
        before = "no error"
    except RuntimeError as e:
        before = str(e)
    out = []
    for tp, cp in shapes:  # several megatron setups over one spawned world
        init_megatron(tp, cp)
        try:
            got: Got = []
            for allgather in (False, True):
                layout = Layout.from_parallel_state([10, 7], [4, 3], allgather_cp=allgather)
                got.append((layout.cp_mode, layout.cp_rank, layout.cp_size))
            assert got[0][1] == parallel_state.get_context_parallel_rank()
            bshd = Layout.from_parallel_state([10, 7], [4, 3], qkv_format="bshd", max_seq_len=12)
            assert bshd.qkv_format == "bshd" and bshd.max_seq_len == 12
            # verl's packing: every sample padded to a multiple of tp * cp * 2
            verl = Layout.from_parallel_state([10, 7], [4, 3], align=tp * cp * 2)
            assert verl.align == tp * cp * 2 and verl.cp_rank == got[0][1]
            given = Layout.from_parallel_state([10, 7], [4, 3], allgather_cp=True,
                                               padded_lengths=[11, 9])
            assert given.padded_lengths == (11, 9) and given.cp_mode == "allgather"
            dist.barrier()
            out.append(got)
        finally:
            destroy_megatron()
    return before, out


@pytest.mark.parametrize("world", [2, 4])
def test_from_parallel_state(world: int) -> None:
    shapes = [(1, 2)] if world == 2 else [(2, 2), (1, 4)]
    results = run_distributed(_worker, world, shapes, timeout=150)
    for rank, (before, got) in enumerate(results):
        assert "parallel_state is not initialized" in before
        for (tp, cp), per_setup in zip(shapes, got, strict=True):
            # megatron's default order "tp-cp-...": tp varies fastest, so cp rank = rank // tp
            cp_rank = rank // tp
            assert per_setup == [("zigzag", cp_rank, cp), ("allgather", cp_rank, cp)]
