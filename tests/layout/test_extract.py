"""extract_responses and shard_responses against the naive oracle of docs/layouts.md."""

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cpslice
from cpslice import extract_responses, shard_responses

from ..support.oracle import Config, expected_share, local_values, response_rows
from ..support.strategies import configs

PROPS = settings(max_examples=150, deadline=None)


def _as_lists(shares: list[torch.Tensor]) -> list[list[float]]:
    return [s[:, 0].tolist() if s.dim() > 1 else s.tolist() for s in shares]


# the edges, always run: docs/layouts.md's example (rank 0 holds none of the response),
# single-token samples only, samples shorter than 2 * cp_size with ranks that hold
# nothing, an allgather response crossing ranks, bshd rows under zigzag; padded
# samples: the verl align=8 example, zigzag widths several chunks longer than needed
# (ranks holding only padding of a sample), an allgather stretched last sample, cp none
EDGES = [
    Config((10,), (4,), "thd", None, "zigzag", 2, None, 0),
    Config((1, 1, 1), (0, 0, 0), "thd", None, "zigzag", 8, None, 0),
    Config((2, 3, 1, 5), (1, 2, 0, 4), "thd", None, "zigzag", 8, None, 1),
    Config((3, 20), (1, 15), "thd", None, "allgather", 4, 6, 0),
    Config((3, 20), (1, 15), "thd", None, "allgather", 8, None, 2),
    Config((7, 2), (3, 1), "bshd", 9, "zigzag", 3, None, 0),
    Config((), (), "thd", None, "allgather", 5, None, 0),
    Config((10, 7), (4, 3), "thd", None, "zigzag", 2, None, 0, None, 8),
    Config((2, 9, 1), (1, 5, 0), "thd", None, "zigzag", 4, None, 1, (24, 16, 8)),
    Config((3, 5, 4), (1, 2, 3), "thd", None, "allgather", 4, None, 0, (3, 5, 30)),
    Config((5, 3), (2, 1), "thd", None, "none", 1, None, 2, None, 4),
]


@PROPS
@given(configs(), st.sampled_from([(), (1,), (3,)]))
@example(EDGES[0], ()).via("edge")
@example(EDGES[1], (3,)).via("edge")
@example(EDGES[2], ()).via("edge")
@example(EDGES[3], (1,)).via("edge")
@example(EDGES[4], ()).via("edge")
@example(EDGES[5], ()).via("edge")
@example(EDGES[6], ()).via("edge")
@example(EDGES[7], ()).via("edge")
@example(EDGES[8], (3,)).via("edge")
@example(EDGES[9], ()).via("edge")
@example(EDGES[10], ()).via("edge")
def test_every_rank_matches_the_oracle(cfg: Config, rest: tuple[int, ...]) -> None:
    for rank in range(cfg.cp):
        layout = cfg.layout(rank)
        values = local_values(cfg, rank, rest)
        shares, none = extract_responses(values, layout)
        assert none is None
        assert len(shares) == len(cfg.total)
        assert _as_lists(shares) == expected_share(cfg, rank)
        for s in shares:
            assert s.shape[1:] == values.shape[1:] and s.dtype == values.dtype


@PROPS
@given(configs())
@example(EDGES[0]).via("edge")
@example(EDGES[2]).via("edge")
@example(EDGES[4]).via("edge")
@example(EDGES[8]).via("edge")
@example(EDGES[9]).via("edge")
def test_union_over_ranks_is_the_no_cp_result(cfg: Config) -> None:
    whole: list[list[float | None]] = [[None] * r for r in cfg.response]
    for rank in range(cfg.cp):
        shares, _ = extract_responses(local_values(cfg, rank), cfg.layout(rank))
        for i, share in enumerate(shares):
            for v in share.tolist():
                offset = int(v) % 1000 - (cfg.total[i] - cfg.response[i] - 1)
                assert whole[i][offset] is None, "two ranks returned the same position"
                whole[i][offset] = v
    none = Config(cfg.total, cfg.response, "thd", None, "none", 1, None, 0)
    reference, _ = extract_responses(local_values(none, 0), none.layout(0))
    assert whole == [r.tolist() for r in reference]


@PROPS
@given(configs(), st.sampled_from([(), (2,)]))
def test_entropy_stays_aligned_and_gradients_reach_exactly_the_response_rows(
    cfg: Config, rest: tuple[int, ...]
) -> None:
    for rank in range(cfg.cp):
        layout = cfg.layout(rank)
        values = local_values(cfg, rank, rest).float().requires_grad_()
        entropy = (-values.detach()).requires_grad_()
        before = values.detach().clone()
        shares, ent = extract_responses(values, layout, entropy)
        assert len(ent) == len(shares)
        for s, e in zip(shares, ent):
            assert torch.equal(e, -s.detach())
            # every share, empty or not, is connected to the input's graph
            assert s.grad_fn is not None and e.grad_fn is not None
        anchor = 0 * (values.sum() + entropy.sum())  # a graph even with no samples
        loss = sum((s.sum() for s in shares), anchor)
        loss = loss + sum((2 * e.sum() for e in ent), torch.zeros(()))
        torch.autograd.backward(loss)
        assert values.grad is not None and entropy.grad is not None
        expected = torch.zeros(values.shape[0])
        expected[response_rows(cfg, rank)] = 1.0
        want = expected.reshape(-1, *([1] * len(rest))).expand_as(values)
        assert torch.equal(values.grad, want)
        assert torch.equal(entropy.grad, 2 * want)
        assert torch.equal(values.detach(), before), "the caller's tensor was modified"


def test_layouts_md_example() -> None:
    rank0 = cpslice.Layout([10], [4], cp_mode="zigzag", cp_rank=0, cp_size=2)
    rank1 = rank0.for_rank(1)
    values = torch.arange(6.0)  # local index i holds value i
    assert extract_responses(values, rank0)[0][0].tolist() == []
    assert extract_responses(values, rank1)[0][0].tolist() == [2.0, 3.0, 4.0, 5.0]


def test_an_empty_share_is_a_view_of_the_input() -> None:
    layout = cpslice.Layout([10], [4], cp_mode="zigzag", cp_rank=0, cp_size=2)
    values = torch.randn(6, 3, dtype=torch.bfloat16, requires_grad=True)
    (share,), _ = extract_responses(values, layout)
    assert share.shape == (0, 3) and share.dtype == torch.bfloat16
    assert share._is_view() and share._base is values
    assert share.grad_fn is not None
    torch.autograd.backward(share.sum())  # takes part in backward
    assert values.grad is not None and torch.equal(values.grad, torch.zeros_like(values))


def test_no_samples() -> None:
    layout = cpslice.Layout([], [], cp_mode="allgather", cp_size=2, cp_rank=1)
    shares, ent = extract_responses(torch.zeros(0), layout, torch.zeros(0))
    assert shares == [] and ent == []


@PROPS
@given(configs(), st.sampled_from([(), (2,)]))
def test_shard_responses_agrees_with_extraction_on_every_rank(
    cfg: Config, rest: tuple[int, ...]
) -> None:
    prompt = [t - r for t, r in zip(cfg.total, cfg.response)]
    full = [
        torch.tensor([float(i * 1000 + p - 1 + k) for k in range(r)]).reshape(-1, *[1] * len(rest))
        .expand(-1, *rest)
        for i, (p, r) in enumerate(zip(prompt, cfg.response))
    ]
    for rank in range(cfg.cp):
        layout = cfg.layout(rank)
        if layout.local_length is None and cfg.mode == "allgather":
            continue  # covered by the error test: shard needs the piece length
        sharded = shard_responses(full, layout)
        extracted, _ = extract_responses(local_values(cfg, rank, rest), layout)
        assert len(sharded) == len(extracted)
        for s, e in zip(sharded, extracted):
            assert torch.equal(s.double(), e)
            if s.numel() and e.numel() == s.numel() and cfg.mode != "zigzag":
                assert s._is_view(), "a single contiguous share is a view"


def test_shard_responses_keeps_dtype_and_makes_views() -> None:
    layout = cpslice.Layout([10, 6], [4, 2], cp_mode="zigzag", cp_rank=1, cp_size=2)
    masks = [torch.ones(4, dtype=torch.bool), torch.tensor([True, False])]
    out = shard_responses(masks, layout)
    assert [m.dtype for m in out] == [torch.bool, torch.bool]
    assert out[0].tolist() == [True] * 4
    # sample 1: L=6, W=8, C=2; rank 1 holds 2-3 and 4-5; span [3, 5): positions 3 and 4
    assert out[1].tolist() == [True, False]
