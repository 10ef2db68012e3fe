"""Every public function accepts the same kinds of integers and reals, with run-time
checking on (this session) and off (``test_errors.py::test_error_tests_pass_unchecked``
runs this file again unchecked): plain ints where reals are allowed, numpy integers and
floats anywhere an int or a real is. One call per public function; a public function
added without one here fails ``test_every_public_function_is_called``."""

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import cpslice
from cpslice import Layout, Support

# numpy scalars of every width a caller may hold, and a plain int where a real goes
INTS: list[Any] = [np.int64(3), np.int32(3), np.int16(3), np.uint8(3), 3]
REALS: list[Any] = [1, np.float32(0.9), np.float64(0.9), np.float16(0.5), np.int64(2), 0.9]

TOTAL, RESPONSE = [5, 4], [2, 1]


def _layout(**kw: Any) -> Layout:
    return Layout([np.int64(t) for t in TOTAL], [np.int32(r) for r in RESPONSE], **kw)


def _tokens() -> list[torch.Tensor]:
    return [torch.arange(t) % 7 for t in TOTAL]


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, 7, generator=torch.Generator().manual_seed(0))


def layout_kinds(i: Any, r: Any) -> None:
    zig = _layout(cp_mode="zigzag", cp_rank=np.int64(1), cp_size=np.int32(2), local_length=np.int16(8))
    assert zig.cp_rank == 1 and zig.for_rank(np.uint8(0)).cp_rank == 0
    assert zig.with_local_length(np.int64(10)).local_length == 10
    assert _layout(qkv_format="bshd", max_seq_len=np.int64(6)).max_seq_len == 6
    left = _layout(qkv_format="bshd", max_seq_len=np.int16(8), row_offsets=[np.int64(3), i])
    assert left.row_offsets == (3, int(i))
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    assert Layout.from_attention_mask(mask, [np.int32(1), i - 1], cp_size=np.int64(1)).row_offsets == (1, 2)
    assert _layout(align=np.int32(4)).padded_lengths == (8, 4)
    assert _layout(padded_lengths=[np.int64(6), i + 4]).padded_lengths == (6, 7)
    assert _layout(qkv_format="bshd", max_seq_len=9, row_offsets=[np.int32(1), i]).row_offsets == (
        1, int(i))
    assert Layout(range(2, 4), range(1, 3)).total_lengths == (2, 3)
    cu: list[Any] = [np.int64(0), np.int64(6), np.int32(12)]
    assert Layout.from_cu_seqlens(cu, TOTAL, RESPONSE, local_length=i + 9).padded_lengths == (6, 6)
    # both samples have prompts of 3: one group, one star of 3 + 2 + 1 positions
    assert _layout(shared_prefix=[np.int64(2)]).padded_lengths == (6,)
    assert _layout(shared_prefix=[i - 2, np.int32(1)]).shared_prefix is None  # groups of 1: none
    star: list[Any] = [np.int64(0), i + 5]
    assert Layout.from_cu_seqlens(star, TOTAL, RESPONSE, shared_prefix=[np.uint8(2)]).padded_lengths == (int(i) + 5,)


def from_parallel_state(i: Any, r: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # megatron-core's parallel_state (the environment, not cpslice) says CP rank 0 of 1;
    # the caller's arguments are what this test varies. megatron-core first, outside the
    # jaxtyping hook: imported from the hooked adapter module, it is compiled from source.
    from megatron.core import parallel_state

    _parallel_state(monkeypatch, parallel_state, 0, 1)
    layout = Layout.from_parallel_state(TOTAL, RESPONSE, local_length=np.int64(9), align=i)
    assert layout.local_length == 9
    rows = Layout.from_parallel_state(TOTAL, RESPONSE, qkv_format="bshd", max_seq_len=9,
                                      row_offsets=[i, np.int64(0)])
    assert rows.row_offsets == (int(i), 0)


def pack_kinds(i: Any, r: Any) -> None:
    layout = _layout()
    assert cpslice.pack([torch.zeros(t) for t in TOTAL], layout, fill=r).shape == (9,)
    assert cpslice.pack(_tokens(), layout, fill=i).dtype == torch.int64
    assert cpslice.shifted_targets(_tokens(), layout, fill=i)[4] == int(i)
    assert cpslice.shifted_targets(_tokens(), layout, fill=i, depth=i - 2)[3] == int(i)  # 3 + 1 + 1 = L_0
    assert cpslice.position_ids(layout).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert cpslice.attention_mask(layout).shape == (9, 9)


def depth_kinds(i: Any, r: Any) -> None:
    """``depth=`` on the extraction side and the log-probs: any int kind."""
    layout = _layout()
    d = i - 2  # 1
    shares, _ = cpslice.extract_responses(_logits(9), layout, depth=d)
    assert [s.shape[0] for s in shares] == RESPONSE
    assert [s.shape[0] for s in cpslice.shard_responses(shares, layout, depth=np.int64(1))] == RESPONSE
    assert cpslice.response_rows(layout, depth=d).rows.tolist() == [1, 2, 6]
    lp, _ = cpslice.response_log_probs(_logits(9), _tokens(), layout, depth=d)
    assert [s.shape[0] for s in lp] == RESPONSE
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 4, generator=gen), torch.randn(7, 4, generator=gen)
    lp, _ = cpslice.response_log_probs_from_hidden(hidden, weight, _tokens(), layout, depth=d)
    assert [s.shape[0] for s in lp] == RESPONSE


def log_probs_kinds(i: Any, r: Any) -> None:
    logits = _logits(9)
    targets = torch.arange(9) % 7
    lp, _ = cpslice.log_probs_and_entropy(logits, targets, temperature=r, chunk_size=i)
    want = torch.log_softmax(logits.double() / float(r), -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp.double(), want, atol=1e-5, rtol=0)
    capped, _ = cpslice.log_probs_and_entropy(logits, targets, softcap=r, vocab_size=i + 4)
    assert bool(capped.isfinite().all())
    for tau in (r, [r, r]):  # one for all samples, or one per sample
        shares, _ = cpslice.response_log_probs(
            logits, _tokens(), _layout(), temperature=tau, chunk_size=i, softcap=r, vocab_size=i + 4
        )
        assert [s.shape[0] for s in shares] == RESPONSE


def hidden_kinds(i: Any, r: Any) -> None:
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 4, generator=gen), torch.randn(7, 4, generator=gen)
    targets = torch.arange(9) % 7
    lp, _ = cpslice.log_probs_and_entropy_from_hidden(
        hidden, weight, targets, temperature=r, chunk_size=i, softcap=r, vocab_size=i + 4
    )
    want, _ = cpslice.log_probs_and_entropy(hidden @ weight.T, targets, temperature=r, softcap=r, vocab_size=i + 4)
    torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)
    shares, _ = cpslice.response_log_probs_from_hidden(
        hidden, weight, _tokens(), _layout(), temperature=[r, r], chunk_size=i, softcap=r, vocab_size=i + 4
    )
    assert [s.shape[0] for s in shares] == RESPONSE


def entropy_kinds(i: Any, r: Any) -> None:
    gen = torch.Generator().manual_seed(3)
    logits, hidden, weight = _logits(9), torch.randn(9, 4, generator=gen), torch.randn(7, 4, generator=gen)
    keys: dict[str, Any] = {"temperature": r, "softcap": r, "vocab_size": i + 4}
    h = cpslice.entropy(logits.view(3, 3, 7), chunk_size=i, **keys)  # [B, S, V] logits: [B, S]
    _, want = cpslice.log_probs_and_entropy(logits, torch.zeros(9, dtype=torch.int64), with_entropy=True, **keys)
    torch.testing.assert_close(h.reshape(9), want, atol=1e-5, rtol=0)
    from_hidden = cpslice.entropy_from_hidden(hidden, weight, chunk_size=i, **keys)
    torch.testing.assert_close(from_hidden, cpslice.entropy(hidden @ weight.T, **keys), atol=1e-5, rtol=0)


def divergence_kinds(i: Any, r: Any) -> None:
    gen = torch.Generator().manual_seed(4)
    student, teacher = torch.randn(9, 7, generator=gen), torch.randn(9, 7, generator=gen)
    beta = r if 0 < float(r) < 1 else np.float32(0.25)
    keys: dict[str, Any] = {"kind": "jsd", "beta": beta, "temperature": r, "softcap": r, "vocab_size": i + 4}
    div = cpslice.vocab_divergence(student.view(3, 3, 7), teacher.view(3, 3, 7), chunk_size=i, **keys)
    torch.testing.assert_close(div.reshape(9), cpslice.vocab_divergence(student, teacher, **keys), atol=1e-5, rtol=0)
    shares = cpslice.response_vocab_distillation(student, teacher, _layout(), chunk_size=i, **keys)
    assert [s.shape[0] for s in shares] == RESPONSE
    keys["temperature"] = [r, r]
    assert [s.shape[0] for s in cpslice.response_vocab_distillation(student, teacher, _layout(), **keys)] == RESPONSE


def distill_kinds(i: Any, r: Any) -> None:
    gen = torch.Generator().manual_seed(2)
    logits, hidden, weight = _logits(9), torch.randn(9, 4, generator=gen), torch.randn(7, 4, generator=gen)
    ids = torch.arange(18).view(9, 2) % 7
    k = i if int(i) <= 7 else 2
    top, top_ids = cpslice.topk_log_probs(logits, k, temperature=r, chunk_size=i, softcap=r, vocab_size=i + 4)
    assert top.shape == (9, int(k))
    assert cpslice.topk_log_probs_from_hidden(hidden, weight, k, temperature=r, chunk_size=i)[1].shape == (9, int(k))
    at = cpslice.log_probs_at(logits, ids, temperature=r, chunk_size=i, softcap=r, vocab_size=i + 4)
    assert cpslice.log_probs_at_from_hidden(hidden, weight, ids, temperature=r, chunk_size=i).shape == at.shape
    beta = r if 0 < float(r) < 1 else np.float32(0.25)
    assert cpslice.topk_divergence(at, at, kind="jsd", beta=beta).shape == (9,)
    teacher = [top[:2], top[5:6]]
    teacher_ids = [top_ids[:2], top_ids[5:6]]
    shares = cpslice.response_distillation(
        logits, teacher, teacher_ids, _layout(), beta=beta, temperature=[r, r], chunk_size=i, softcap=r,
        vocab_size=i + 4,
    )
    assert [s.shape[0] for s in shares] == RESPONSE
    shares = cpslice.response_distillation_from_hidden(
        hidden, weight, teacher, teacher_ids, _layout(), beta=beta, temperature=r, chunk_size=i
    )
    assert [s.shape[0] for s in shares] == RESPONSE
    values, chosen = cpslice.response_topk_log_probs(logits, k, _layout(), temperature=[r, r], chunk_size=i,
                                                     softcap=r, vocab_size=i + 4)
    assert [v.shape for v in values] == [c.shape for c in chosen] == [(n, int(k)) for n in RESPONSE]
    values, _ = cpslice.response_topk_log_probs_from_hidden(hidden, weight, k, _layout(), temperature=r, chunk_size=i)
    assert [v.shape[0] for v in values] == RESPONSE


def support_kinds(i: Any, r: Any) -> None:
    offsets: list[list[Any]] = [[0, 1, 2], [0, np.int64(1)]]
    support = Support.from_responses([[i, np.int64(1)], [np.int32(2)]], offsets, _layout())
    assert support.num_rows == 9
    lp, _ = cpslice.log_probs_and_entropy(_logits(9), torch.arange(9) % 7, temperature=r, support=support)
    assert bool(lp.isfinite().all())


def reducer_kinds(i: Any, r: Any) -> None:
    layout = _layout()
    values = [torch.ones(n) for n in RESPONSE]
    masks = [torch.ones(n) for n in RESPONSE]
    denominators = [r, i]
    assert float(cpslice.sample_means(values, masks, layout, denominators=denominators)[1]) == pytest.approx(
        1 / float(i)
    )
    assert float(cpslice.sum_of_sample_means(values, masks, layout, denominators=denominators)) > 0
    assert float(cpslice.sum_of_tokens(values, masks, layout)) == 3


def no_numbers(i: Any, r: Any) -> None:
    """The public functions without an int or real argument: called once, plainly."""
    layout = _layout()
    values = _logits(9)
    shares, _ = cpslice.extract_responses(values, layout)
    assert [s.shape[0] for s in cpslice.shard_responses(shares, layout)] == RESPONSE
    assert cpslice.redistribute(shares, layout, layout)[0] is shares[0]
    assert cpslice.gather_responses(shares, layout)[0] is shares[0]
    assert cpslice.response_rows(layout).counts == RESPONSE
    assert cpslice.extraction_strategy(layout) == "none-thd"
    masks = [torch.ones(n) for n in RESPONSE]
    assert cpslice.sample_max(shares, masks, layout).shape == (2, 7)
    assert cpslice.sample_min([s[:, 0] for s in shares], masks, layout).shape == (2,)
    assert torch.equal(cpslice.unshard(values, layout), values)
    assert cpslice.backend_for(values) in ("eager", "compiled", "triton")
    cpslice.clear_caches()


CALLS: dict[str, Callable[..., None]] = {
    "Layout": layout_kinds,
    "pack": pack_kinds,
    "shifted_targets": pack_kinds,
    "position_ids": pack_kinds,
    "attention_mask": pack_kinds,
    "log_probs_and_entropy": log_probs_kinds,
    "response_log_probs": log_probs_kinds,
    "log_probs_and_entropy_from_hidden": hidden_kinds,
    "response_log_probs_from_hidden": hidden_kinds,
    "Support": support_kinds,
    "entropy": entropy_kinds,
    "entropy_from_hidden": entropy_kinds,
    **dict.fromkeys(["vocab_divergence", "response_vocab_distillation"], divergence_kinds),
    **dict.fromkeys(
        ["log_probs_at", "log_probs_at_from_hidden", "topk_log_probs", "topk_log_probs_from_hidden",
         "topk_divergence", "response_distillation", "response_distillation_from_hidden",
         "response_topk_log_probs", "response_topk_log_probs_from_hidden"],
        distill_kinds,
    ),
    **dict.fromkeys(["extract_responses", "shard_responses", "response_rows"], depth_kinds),
    "sample_means": reducer_kinds,
    "sum_of_sample_means": reducer_kinds,
    "sum_of_tokens": reducer_kinds,
    **dict.fromkeys(
        ["redistribute", "gather_responses", "extraction_strategy", "sample_max", "sample_min", "clear_caches",
         "unshard", "backend_for"],
        no_numbers,
    ),
}
NOT_CALLABLE = {"LayoutError", "ResponseRows", "Strategy"}  # an error, a record, a type


def _name(call: object) -> str:
    return getattr(call, "__name__", repr(call))


def test_every_public_function_is_called() -> None:
    assert set(cpslice.__all__) - NOT_CALLABLE == set(CALLS)


# every int kind and every real kind at least once per call (not their whole product)
PAIRS = [(INTS[j % len(INTS)], r) for j, r in enumerate(REALS)]


@pytest.mark.parametrize(("i", "r"), PAIRS, ids=repr)
@pytest.mark.parametrize("call", sorted(set(CALLS.values()), key=_name), ids=_name)
def test_numpy_scalars_and_ints_are_accepted(call: Callable[..., None], i: Any, r: Any) -> None:
    call(i, r)


@pytest.mark.parametrize("i", INTS, ids=repr)
def test_from_parallel_state_takes_them_too(i: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from_parallel_state(i, 1.0, monkeypatch)


def _parallel_state(monkeypatch: pytest.MonkeyPatch, state: Any, rank: int, size: int) -> None:
    """megatron-core's parallel_state as an initialized CP group of ``size`` would read
    on its rank ``rank`` (tests/distributed/test_end_to_end.py reads a real one)."""
    monkeypatch.setattr(state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(state, "get_context_parallel_rank", lambda: rank)
    monkeypatch.setattr(state, "get_context_parallel_world_size", lambda: size)
