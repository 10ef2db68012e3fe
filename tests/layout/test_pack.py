"""pack, shifted_targets and response_rows against the naive oracle of docs/layouts.md."""

import pytest
import torch
from hypothesis import given, settings

from cpslice import Layout, LayoutError, extract_responses, pack, response_rows, shifted_targets

from ..support.oracle import Config, local_length, local_map, local_values
from ..support.oracle import response_rows as oracle_rows
from ..support.strategies import configs

PROPS = settings(max_examples=120, deadline=None)


def _fixed(cfg: Config, rank: int) -> Layout:
    return cfg.layout(rank).with_local_length(local_length(cfg))


@PROPS
@given(configs())
def test_pack_lays_samples_out_as_the_oracle(cfg: Config) -> None:
    per_sample = [torch.tensor([i * 1000.0 + p for p in range(t)]) for i, t in enumerate(cfg.total)]
    for rank in range(cfg.cp):
        packed = pack(per_sample, _fixed(cfg, rank), fill=-1)
        assert torch.equal(packed, local_values(cfg, rank).float())


@PROPS
@given(configs())
def test_shifted_targets_are_the_next_token_of_the_same_sample(cfg: Config) -> None:
    tokens = [torch.arange(t) + 1000 * i for i, t in enumerate(cfg.total)]
    for rank in range(cfg.cp):
        got = shifted_targets(tokens, _fixed(cfg, rank), fill=-7)
        want = [
            i * 1000 + p + 1 if m is not None and (p := m[1]) + 1 < cfg.total[(i := m[0])] else -7
            for m in local_map(cfg, rank)
        ]
        assert got.dtype == torch.int64 and got.tolist() == want


@PROPS
@given(configs())
def test_response_rows_are_the_extracted_rows(cfg: Config) -> None:
    for rank in range(cfg.cp):
        layout = _fixed(cfg, rank)
        rows, counts = response_rows(layout)
        assert rows.tolist() == oracle_rows(cfg, rank)
        shares, _ = extract_responses(local_values(cfg, rank), layout)
        assert counts == [s.shape[0] for s in shares]


def test_allgather_last_position_takes_its_target_from_the_next_piece() -> None:
    # one sample of 10 tokens over 2 ranks of 5: rank 0's row 4 holds position 4,
    # whose target, token 5, lives in rank 1's piece
    layout = Layout([10], [6], cp_mode="allgather", cp_size=2, cp_rank=0)
    tokens = [torch.arange(100, 110)]
    assert shifted_targets(tokens, layout).tolist() == [101, 102, 103, 104, 105]
    assert shifted_targets(tokens, layout.for_rank(1)).tolist() == [106, 107, 108, 109, 0]


def test_pack_is_differentiable_and_keeps_the_caller_tensors() -> None:
    layout = Layout([3, 2], [1, 1], cp_mode="zigzag", cp_size=2, cp_rank=1)
    a = torch.randn(3, 2, requires_grad=True)
    b = torch.randn(2, 2, requires_grad=True)
    before = (a.detach().clone(), b.detach().clone())
    out = pack([a, b], layout, fill=0.5)
    assert out.shape == (4, 2)
    torch.autograd.backward(out.sum())
    assert a.grad is not None and b.grad is not None
    # zigzag cp2: W=4, C=1 for both; rank 1 holds positions 1 and 2 of each sample
    assert a.grad[:, 0].tolist() == [0.0, 1.0, 1.0]
    assert b.grad[:, 0].tolist() == [0.0, 1.0]
    assert torch.equal(a.detach(), before[0]) and torch.equal(b.detach(), before[1])


def test_input_errors() -> None:
    layout = Layout([3, 2], [1, 1])
    with pytest.raises(LayoutError, match=r"sample 1: tokens\[1\] has 3 positions but total_length is 2"):
        shifted_targets([torch.arange(3), torch.arange(3)], layout)
    with pytest.raises(LayoutError, match=r"per_sample has 1 samples but the layout has 2"):
        pack([torch.zeros(3)], layout)
    with pytest.raises(LayoutError, match=r"sample 1: .*\(trailing shape and dtype must agree\)"):
        pack([torch.zeros(3), torch.zeros(2, dtype=torch.int64)], layout)
    with pytest.raises(TypeError, match=r"1-D integer tensor|tokens"):
        shifted_targets([torch.zeros(3), torch.zeros(2)], layout)
    with pytest.raises(LayoutError, match=r"local_length=T"):
        response_rows(Layout([3, 2], [1, 1], cp_mode="allgather", cp_size=2))


def test_lm_head_on_response_rows_only_equals_the_full_path() -> None:
    from cpslice import log_probs_and_entropy, response_log_probs

    total, response = [12, 9, 5, 1], [3, 8, 0, 0]
    tokens = [torch.randint(0, 30, (t,)) for t in total]
    head = torch.nn.Linear(8, 30, bias=False)
    for rank in range(2):
        layout = Layout(total, response, cp_mode="zigzag", cp_rank=rank, cp_size=2)
        hidden = torch.randn(pack(tokens, layout).shape[0], 8)
        rows, counts = response_rows(layout)
        lp, ent = log_probs_and_entropy(
            head(hidden[rows]), shifted_targets(tokens, layout)[rows], with_entropy=True
        )
        full_lp, full_ent = response_log_probs(head(hidden), tokens, layout, with_entropy=True)
        for a, b in zip(torch.split(lp, counts), full_lp):
            assert torch.allclose(a, b, atol=1e-5)
        for a, b in zip(torch.split(ent, counts), full_ent):
            assert torch.allclose(a, b, atol=1e-5)
