"""Sample lengths that reach the edges of the layout rules, for the tests' batches."""

import random

from cpslice._types import CpMode

KINDS = ("single token", "shorter than 2cp", "empty response", "whole response", "random")


def _draw(rng: random.Random, kind: str, cp: int) -> tuple[int, int]:
    """One sample's ``(total, response)`` of ``kind``."""
    longest = 6 * cp + 3
    if kind == "single token":
        return 1, 0
    if kind == "shorter than 2cp":
        length = rng.randint(2, max(2, 2 * cp - 1))
        return length, rng.randint(0, length - 1)
    if kind == "empty response":
        return rng.randint(2, longest), 0
    if kind == "whole response":
        length = rng.randint(max(2, 4 * cp), longest)
        return length, length - 1
    length = rng.randint(2, longest)
    return length, rng.randint(1, length - 1)


def edge_lengths(n: int, cp: int, seed: int) -> tuple[list[int], list[int]]:
    """``n`` samples' ``(total, response)`` lengths in a random order: one of each of
    ``KINDS`` first (a lone token, so no response; a sample shorter than a zigzag pair
    of chunks at ``cp``; a prompt with no response; a response of every position but
    the first, long enough to cross every chunk; a random split), then random kinds.
    The same arguments give the same lengths."""
    rng = random.Random(seed)
    pairs = [_draw(rng, KINDS[i] if i < len(KINDS) else rng.choice(KINDS), cp) for i in range(n)]
    rng.shuffle(pairs)
    return [t for t, _ in pairs], [r for _, r in pairs]


def sparse_lengths(mode: CpMode, cp: int) -> tuple[list[int], list[int]]:
    """Samples whose responses leave some of ``cp`` ranks with none at all.

    zigzag: no sample is longer than 2 tokens, so each sits in chunks of one position
    and every response token is position 0, on rank 0. allgather: one sample of
    ``4 * cp`` tokens whose one response token ends it, in the last rank's piece."""
    if mode == "allgather":
        return [4 * cp], [1]
    return [2, 1, 2], [1, 0, 1]
