"""The session's gloo worlds (tests/support/_dist.py): a failing rank re-raises here with its
traceback and the world serves the next task; a task's process-wide changes do not
reach the next one; a dead rank or a hang fails the test, and the next task gets a
new world."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from ..support._dist import destroy_megatron, init_megatron, run_distributed

# cpslice is imported in the tasks that use it, not here: the ranks of the world of 1
# import this module, and cpslice in debug mode takes them seconds of CPU


def _pid(rank: int, world: int) -> int:
    return os.getpid()


def _fails_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError(f"rank {rank} of {world} refuses")
    return rank


def test_a_failing_rank_reraises_with_its_traceback_and_the_world_serves_on() -> None:
    before = run_distributed(_pid, 2)
    with pytest.raises(AssertionError, match=r"(?s)rank 1:\n.*in _fails_on_rank_1\n.*ValueError: rank 1 of 2 refuses"):
        run_distributed(_fails_on_rank_1, 2)
    assert run_distributed(_pid, 2) == before
    assert len(set(before)) == 2 and os.getpid() not in before


def _state(rank: int, world: int) -> tuple[list[float], int, str, str, str | None]:
    """What a task finds: the first draws of the global RNG, the thread count, the
    all_reduce and cpslice's all-gather it would call, the environment."""
    from cpslice._vocab import stats as _logprob

    return (torch.rand(3).tolist(), torch.get_num_threads(), repr(dist.all_reduce),
            repr(_logprob._all_gather), os.environ.get("CPSLICE_TEST_LEAK"))


def _leaky(rank: int, world: int) -> None:
    from cpslice._vocab import stats as _logprob  # imported by _state before: the world restores its globals

    torch.manual_seed(1234 + rank)
    torch.set_num_threads(torch.get_num_threads() + 1)
    dist.all_reduce = lambda *args, **kwargs: None
    _logprob._all_gather = None  # type: ignore[assignment]
    os.environ["CPSLICE_TEST_LEAK"] = "1"


def test_a_task_changes_nothing_for_the_next_one() -> None:
    fresh = run_distributed(_state, 2)
    run_distributed(_leaky, 2)
    assert run_distributed(_state, 2) == fresh
    # (each rank its own draws: torch seeds a fresh process at random)
    assert all("all_reduce" in f[2] and "function" in f[3] and f[4] is None for f in fresh)


def _leaves_megatron(rank: int, world: int) -> None:
    init_megatron(1, world)


def _uses_megatron(rank: int, world: int) -> int:
    from megatron.core import parallel_state

    init_megatron(2, 1)
    try:
        return int(parallel_state.get_tensor_model_parallel_rank())
    finally:
        destroy_megatron()


def test_a_task_that_leaves_megatron_initialized_fails_and_the_next_one_starts_clean() -> None:
    with pytest.raises(AssertionError, match="left megatron-core's parallel_state initialized"):
        run_distributed(_leaves_megatron, 2)
    assert run_distributed(_uses_megatron, 2) == [0, 1]


def _live(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_backend(group)
    except ValueError:  # destroyed, or this rank is no member
        return False
    return True


def _megatron_groups(rank: int, world: int) -> tuple[int, int]:
    from ..support import _dist

    init_megatron(2, 1)
    made = list(_dist._MEGATRON_GROUPS)
    live = sum(map(_live, made))
    destroy_megatron()
    return live, sum(map(_live, made))


def test_destroy_megatron_destroys_its_groups_too() -> None:
    # megatron-core's destroy_model_parallel forgets its groups but leaves them alive,
    # and a live gloo group costs its rank CPU while it idles: the session's worlds
    # initialize megatron-core a dozen times
    for live, left in run_distributed(_megatron_groups, 2):
        assert live > 5 and left == 0


def _dies(rank: int, world: int) -> None:
    os._exit(3)


def _hangs(rank: int, world: int) -> None:
    time.sleep(60)


def test_a_dead_rank_or_a_hang_fails_and_the_next_task_gets_a_new_world() -> None:
    # a world of its own (1 rank: it imports torch only), so the shared ones are not killed
    first = run_distributed(_pid, 1)
    with pytest.raises(RuntimeError, match="rank 0 of the test world of 1 died with exit code 3"):
        run_distributed(_dies, 1, timeout=60)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="1 of 1 ranks did not finish within 2"):
        run_distributed(_hangs, 1, timeout=2)  # on the new world the death made
    assert time.monotonic() - start < 10
    assert run_distributed(_pid, 1) != first  # and the hang's killed world is replaced too


def _miscounts_groups(rank: int, world: int) -> None:
    import torch.distributed.distributed_c10d as c10d

    c10d._world.group_count += rank  # as a rank whose new_group failed halfway would


@pytest.mark.discards_world  # run after every other test of the shared world of 2
def test_ranks_that_disagree_on_their_groups_fail_the_task_and_leave_the_world() -> None:
    first = run_distributed(_pid, 2)
    with pytest.raises(RuntimeError, match=r"different numbers of process groups \(\{0: \d+, 1: \d+\}\)"):
        run_distributed(_miscounts_groups, 2)
    assert run_distributed(_pid, 2) != first
