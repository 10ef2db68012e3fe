"""torch's context-parallel load balancers, for tests/distributed/test_balancers.py: where torch keeps
them (a private module: ``load_balancers`` fails, naming it, when torch moves it), the
cases they index, and what each rank holds, read straight from the index.

torch's sharding (``_context_parallel_buffers``, behind ``context_parallel`` and
``_context_parallel_shard``) gathers every ``[B, S, ...]`` buffer along dimension 1 by the
balancer's ``[1, S]`` or ``[B, S]`` index, then keeps rank ``r``'s contiguous ``S / c``
columns of every row. A case is one such buffer: ``rows`` rows of the stream of the
samples' extents (thd: the samples' padded extents back to back, ``rows`` packed rows
of whole documents; bshd: one sample per row, at its column ``o_i``).
"""

import importlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch
from torch import Tensor

from cpslice import Layout
from cpslice._types import LayoutMode

MODULE = "torch.distributed.tensor.experimental._context_parallel._load_balancer"
CLASSES = ("_HeadTailLoadBalancer", "_PerDocumentHeadTailLoadBalancer", "_PTRRLoadBalancer")
BLOCK = 128  # flex attention's block: PTRR deals blocks of 128 positions


def load_balancers() -> ModuleType:
    """torch's private load-balancer module, or an AssertionError that says it moved."""
    where = f"torch {torch.__version__}"
    try:
        module = importlib.import_module(MODULE)
    except ImportError as err:
        raise AssertionError(
            f"{where} has no module {MODULE} ({err}): the private module of the context-parallel load "
            f"balancers moved; find {', '.join(CLASSES)} and update tests/support/balancers.py and docs/recipes.md"
        ) from None
    missing = [name for name in CLASSES if not isinstance(getattr(module, name, None), type)]
    if missing:
        raise AssertionError(f"{where}'s {MODULE} has no {', '.join(missing)}: the private load balancers "
                             "moved or were renamed; update tests/support/balancers.py and docs/recipes.md")
    return module


@dataclass(frozen=True)
class Case:
    """One buffer of samples, the balancer's index of it, and the knobs of its step."""

    name: str
    fmt: Literal["thd", "bshd"]
    total: list[int]
    response: list[int]
    widths: list[int]  # each sample's extent W_i (bshd: the row width S)
    offsets: list[int]  # bshd: each row's first token column o_i; thd: zeros
    rows: int  # the buffer's rows B (thd: packed rows of whole documents)
    index: Tensor  # the balancer's index, as torch returns it: [1, S] or [B, S]
    order: Tensor  # what Layout.from_order gets: the index, or the stream order of its rows
    mode: LayoutMode  # the cp_mode Layout.from_order must give
    other: Tensor  # a random order of the same samples, for redistribution between orders
    other_widths: list[int]  # its extents (thd; bshd: the same rows)
    seed: int
    temperature: list[float]
    softcap: float | None
    vocab: int  # columns of the logits
    vocab_size: int | None  # the distribution's ids, [0, vocab_size) (None: all)
    support: bool  # restrict the log-probs to random per-token sets

    def geometry(self, widths: list[int] | None = None) -> dict[str, Any]:
        """``Layout``'s arguments for this case's extents (or for ``widths``)."""
        if self.fmt == "thd":
            return {"padded_lengths": self.widths if widths is None else widths}
        return {"qkv_format": "bshd", "max_seq_len": self.widths[0], "row_offsets": self.offsets}

    def layout(self, rank: int, size: int) -> Layout:
        return Layout.from_order(self.order, self.total, self.response, cp_rank=rank, cp_size=size,
                                 **self.geometry())

    def other_layout(self, rank: int, size: int) -> Layout:
        geometry = self.geometry(self.other_widths)
        if self.fmt == "bshd":
            geometry["row_offsets"] = None  # the other rows start at column 0
        return Layout.from_order(self.other, self.total, self.response, cp_rank=rank, cp_size=size, **geometry)


def stream(widths: list[int], offsets: list[int], total: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """For every stream position (the extents back to back): its sample, its position in
    the sample (padding: sample -1), and where each sample's token 0 sits."""
    extent = torch.tensor(widths, dtype=torch.int64)
    start = torch.cumsum(extent, 0) - extent
    first = start + torch.tensor(offsets, dtype=torch.int64)
    sample = torch.repeat_interleave(torch.arange(len(widths)), extent)
    pos = torch.arange(int(extent.sum())) - first[sample]
    length = torch.tensor(total, dtype=torch.int64)[sample]
    pad = (pos < 0) | (pos >= length)
    return torch.where(pad, -1, sample), torch.where(pad, -1, pos), first


def held(order: Tensor, fmt: str, widths: list[int], rank: int, size: int) -> Tensor:
    """The stream positions of rank ``rank``'s local rows under ``order``, read as
    Layout.from_order's docstring states it (thd: ``order[r*T:(r+1)*T]``; bshd: row after
    row, ``b * S + order[b, r*S/c:(r+1)*S/c]``)."""
    if fmt == "thd":
        flat = order.reshape(-1).long()
        t = flat.numel() // size
        return flat[rank * t:(rank + 1) * t]
    rows, seq = len(widths), widths[0]
    full = order.long().reshape(-1, seq).expand(rows, seq)
    piece = full[:, rank * seq // size:(rank + 1) * seq // size]
    return (piece + seq * torch.arange(rows)[:, None]).reshape(-1)


def places(positions: Tensor, sample: Tensor, pos: Tensor) -> list[tuple[int, int] | None]:
    """Per local row holding stream position ``positions[j]``: (sample, position), or None."""
    return [None if int(sample[s]) < 0 else (int(sample[s]), int(pos[s])) for s in positions.tolist()]


def share_offsets(rows: list[tuple[int, int] | None], total: list[int], response: list[int]) -> list[Tensor]:
    """Per sample, the response elements a rank's rows hold (the positions of its response
    span, ascending, less ``P_i - 1``): what its shares hold, in their order."""
    found: list[list[int]] = [[] for _ in total]
    for row in rows:
        if row is not None:
            i, p = row
            first = total[i] - response[i] - 1
            if first <= p < total[i] - 1:
                found[i].append(p - first)
    return [torch.tensor(sorted(f), dtype=torch.int64) for f in found]


def torch_shard(mesh: Any, buffers: list[Tensor], index: Tensor) -> list[Tensor]:
    """What torch's ``_context_parallel_shard`` leaves on this rank of ``mesh`` of each
    ``[B, S, ...]`` buffer, rearranged by ``index`` (a balancer's, given as it returned it).
    torch's global context-parallel switches it sets are put back."""
    from torch.distributed.tensor.experimental._context_parallel import _attention, _context_parallel_shard
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _LoadBalancer

    class Given(_LoadBalancer):
        def _generate_indices(self, restore: bool = False) -> Tensor:
            return torch.argsort(index, 1) if restore else index

    saved = (_attention._dispatch_mode, _attention._cp_options.enable_load_balance)
    try:
        out = _context_parallel_shard(mesh, buffers, [1] * len(buffers), Given())
    finally:
        _attention._dispatch_mode, _attention._cp_options.enable_load_balance = saved
    assert all(isinstance(x, Tensor) for x in out)
    return [x for x in out if isinstance(x, Tensor)]


# ---------------------------------------------------------------- the cases


def _round(value: int, step: int) -> int:
    return -(-value // step) * step


def _lengths(rng: random.Random, n: int, longest: int) -> tuple[list[int], list[int]]:
    """A lone token, a prompt with no response, a response of all but one token, then random."""
    pairs = [(1, 0), (rng.randint(2, longest), 0), (longest, longest - 1)]
    for _ in range(n - 3):
        t = rng.randint(2, longest)
        pairs.append((t, rng.randint(1, t - 1)))
    rng.shuffle(pairs)
    return [t for t, _ in pairs], [r for _, r in pairs]


def _other(rng: random.Random, case: dict[str, Any], size: int) -> tuple[Tensor, list[int]]:
    """A random order of the same samples: thd over other extents, bshd per row."""
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    if case["fmt"] == "bshd":
        seq = case["widths"][0]
        return torch.stack([torch.randperm(seq, generator=gen) for _ in case["total"]]), case["widths"]
    widths = [t + rng.randint(0, 2) for t in case["total"]]
    widths[-1] += -sum(widths) % size
    return torch.randperm(sum(widths), generator=gen), widths


def finish(rng: random.Random, size: int, name: str, order: Tensor | None = None, **case: Any) -> Case:
    """A Case of ``case``'s fields, the step's knobs drawn (a softcap, a padded vocabulary,
    a support in turns), its other order random."""
    other, other_widths = _other(rng, case, size)
    vocab = rng.randint(5, 9)
    seed = rng.randint(0, 2**31)
    knobs = seed % 3
    return Case(name=name, order=case["index"] if order is None else order, other=other,
                other_widths=other_widths, seed=seed,
                temperature=[rng.choice([0.6, 1.0, 1.4]) for _ in case["total"]],
                softcap=4.0 if knobs == 1 else None, vocab=vocab,
                vocab_size=vocab - 2 if knobs != 0 else None, support=knobs != 2, **case)


def thd_cases(size: int, rng: random.Random) -> list[Case]:
    """Packed rows of documents: head-tail over the whole row, head-tail of one sample
    (zigzag), per-document head-tail, and PTRR over a document-causal BlockMask."""
    lb = load_balancers()
    from torch.nn.attention.flex_attention import create_block_mask

    out = []
    total, response = _lengths(rng, 8, 6 * size + 3)
    widths = [t + rng.choice([0, 0, 1, 3]) for t in total]
    widths[-1] += -sum(widths) % (2 * size)
    index = lb._HeadTailLoadBalancer(sum(widths), size, "cpu")._generate_indices()
    out.append(finish(rng, size, "head-tail, packed row", fmt="thd", total=total, response=response,
                      widths=widths, offsets=[0] * 8, rows=1, index=index, mode="order"))
    one = _round(6 * size + 3, 2 * size)
    index = lb._HeadTailLoadBalancer(one, size, "cpu")._generate_indices()
    out.append(finish(rng, size, "head-tail, one sample", fmt="thd", total=[6 * size + 3], response=[4 * size],
                      widths=[one], offsets=[0], rows=1, index=index, mode="zigzag"))
    total, response = _lengths(rng, 7, 6 * size + 3)
    widths = [_round(t, 2 * size) + rng.choice([0, 2 * size]) for t in total]
    index = lb._PerDocumentHeadTailLoadBalancer([widths], size, "cpu")._generate_indices()
    out.append(finish(rng, size, "per-document head-tail", fmt="thd", total=total, response=response,
                      widths=widths, offsets=[0] * 7, rows=1, index=index, mode="order"))
    widths = [1, 300, 2, 180, 401, 140]  # 8 blocks of 128: documents across blocks
    total, response = [1, 297, 2, 180, 390, 140], [0, 100, 1, 0, 200, 139]
    doc = torch.repeat_interleave(torch.arange(len(widths)), torch.tensor(widths))

    def document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (q >= kv) & (doc[q] == doc[kv])

    mask = create_block_mask(document_causal, 1, 1, sum(widths), sum(widths), device="cpu")
    index = lb._PTRRLoadBalancer(mask, size)._generate_indices()
    out.append(finish(rng, size, "PTRR, document-causal", fmt="thd", total=total, response=response,
                      widths=widths, offsets=[0] * 6, rows=1, index=index, mode="order"))
    return out


def bshd_cases(size: int, rng: random.Random) -> list[Case]:
    """One sample per row at its column: head-tail's one index for every row (zigzag),
    per-document head-tail with other documents in every row ([B, S]), and PTRR over
    each row's causal mask of its tokens ([B, S])."""
    lb = load_balancers()
    from torch.nn.attention.flex_attention import create_block_mask

    seq = 4 * size
    total, offsets = [1, seq, 5, seq - 3], [seq - 1, 0, 2, 3]
    response = [0, seq - 1, 0, 2]
    index = lb._HeadTailLoadBalancer(seq, size, "cpu")._generate_indices()
    out = [finish(rng, size, "head-tail, rows", fmt="bshd", total=total, response=response, widths=[seq] * 4,
                  offsets=offsets, rows=4, index=index, mode="zigzag")]
    seq = 6 * size
    docs = [[seq], [2 * size, 4 * size], [4 * size, 2 * size]]  # other documents in every row
    index = lb._PerDocumentHeadTailLoadBalancer(docs, size, "cpu")._generate_indices()
    out.append(finish(rng, size, "per-document head-tail, rows", fmt="bshd", total=[seq - 1, 4, seq],
                      response=[seq - 3, 2, seq // 2], widths=[seq] * 3, offsets=[1, seq - 4, 0], rows=3,
                      index=index, mode="order"))
    seq = 4 * BLOCK
    total, offsets, response = [seq, 200, 37], [0, 100, 300], [300, 150, 20]
    first, last = torch.tensor(offsets), torch.tensor(offsets) + torch.tensor(total)

    def causal_tokens(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (q >= kv) & (kv >= first[b]) & (q < last[b])

    mask = create_block_mask(causal_tokens, 3, 1, seq, seq, device="cpu")
    index = lb._PTRRLoadBalancer(mask, size)._generate_indices()
    out.append(finish(rng, size, "PTRR, rows", fmt="bshd", total=total, response=response, widths=[seq] * 3,
                      offsets=offsets, rows=3, index=index, mode="order"))
    return out


def rows_cases(size: int, rng: random.Random, stream_order: Callable[[Tensor, int, int], Tensor]) -> list[Case]:
    """Two packed rows of whole documents (torchtitan's batch of several rows): per-document
    head-tail's ``[B, S]`` index and head-tail's ``[1, S]`` for both rows, read as one thd
    stream by docs/recipes.md's ``stream_order``."""
    lb = load_balancers()
    seq = 6 * size
    widths = [2 * size, 4 * size, seq]  # row 0: two documents; row 1: one
    total, response = [2 * size - 1, 4 * size, seq - 2], [1, 4 * size - 1, 3]
    out = []
    for name, index in [
        ("per-document head-tail, 2 packed rows",
         lb._PerDocumentHeadTailLoadBalancer([widths[:2], widths[2:]], size, "cpu")._generate_indices()),
        ("head-tail, 2 packed rows", lb._HeadTailLoadBalancer(seq, size, "cpu")._generate_indices()),
    ]:
        out.append(finish(rng, size, name, stream_order(index, 2, size), fmt="thd", total=total,
                          response=response, widths=widths, offsets=[0] * 3, rows=2, index=index, mode="order"))
    return out
