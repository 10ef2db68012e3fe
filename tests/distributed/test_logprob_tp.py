"""The vocabulary split over real gloo TP groups, on a world of 4 ranks (TP 4 on the
world group, then TP 2 on two subgroups): each rank's values equal the float64
full-vocabulary reference, its gradient the reference's part of its shard, and each
path enters only the collectives it should. The cases and the workers that run them
on every rank are in tests/support/tp_cases.py, sequence parallelism's in tests/support/sequence_cases.py."""

from ..support._dist import run_distributed
from ..support.sequence_cases import sequence_worker
from ..support.tp_cases import (
    LINEAR_CASES,
    LINEAR_SUPPORT_CASES,
    LOGITS_CASES,
    SUPPORT_CASES,
    linear_worker,
    logits_worker,
    support_worker,
)

WORLD = 4


def test_vocab_parallel_matches_full_vocabulary() -> None:
    # the logits path, eager and (two cases) compiled; one all-gather forward, none backward
    results = run_distributed(logits_worker, WORLD, timeout=200)
    assert results == [[(WORLD, len(LOGITS_CASES)), (2, len(LOGITS_CASES))]] * WORLD


def test_vocab_parallel_supports_match_the_masked_reference() -> None:
    results = run_distributed(support_worker, WORLD, timeout=200)
    assert results == [[(WORLD, len(SUPPORT_CASES)), (2, len(SUPPORT_CASES))]] * WORLD


def test_vocab_parallel_hidden_state_path_matches_the_reference() -> None:
    # the LM-head weight split: one all-gather forward, one all-reduce backward, then supports
    results = run_distributed(linear_worker, WORLD, timeout=200)
    linear = len(LINEAR_CASES) + len(LINEAR_SUPPORT_CASES)
    assert results == [[(WORLD, linear), (2, linear)]] * WORLD


def test_sequence_parallel_hidden_shards_match_the_reference() -> None:
    # each TP rank's [T / tp, H] shard: one all-gather of it and one of the statistics
    # forward, one reduce-scatter backward; row functions, response forms, distillation
    results = run_distributed(sequence_worker, WORLD, timeout=200)
    assert results == [[(WORLD, 11), (2, 11)]] * WORLD
