"""Every bad input gets a LayoutError or TypeError naming the sample, values and rule.

Wrong kind -> TypeError, wrong lengths/shapes/values -> LayoutError. These tests run
twice: here (checked), and unchecked in a fresh interpreter (the last test), where only
cpslice's own exception and message pass.
"""

import re
from typing import Any

import numpy as np
import pytest
import torch

from cpslice import (
    Layout,
    LayoutError,
    extract_responses,
    gather_responses,
    log_probs_and_entropy,
    pack,
    redistribute,
    response_log_probs,
    shard_responses,
    shifted_targets,
    sum_of_sample_means,
    sum_of_tokens,
)

from ..support import background
from ..support.checked import CHECKED, refused


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (([3, 4.0], [1, 1]), {}, TypeError, r"sample 1: total_length 4\.0 is a float, not an int"),
        (([3, True], [1, 0]), {}, TypeError, r"sample 1: total_length True is a bool, not an int"),
        (([3, 4], [1, 1.0]), {}, TypeError, r"sample 1: response_length 1\.0 is a float"),
        (([3, np.True_], [1, 0]), {}, TypeError, r"sample 1: total_length .* not an int"),
        ((torch.tensor([3]), [1]), {}, TypeError, r"total_lengths must be a sequence of ints, got "
         r"a Tensor \(call \.tolist\(\) on it first\)"),
        ((np.array([3]), [1]), {}, TypeError, r"total_lengths must be a sequence .*\.tolist\(\)"),
        (("34", [1, 1]), {}, TypeError, r"total_lengths must be a sequence of ints, got a str"),
        (([3], [1]), {"cp_size": 2.0, "cp_mode": "zigzag"}, TypeError, r"cp_size 2\.0 is a float"),
        (([3], [1]), {"cp_rank": True}, TypeError, r"cp_rank True is a bool, not an int"),
        (([3], [1]), {"local_length": "8"}, TypeError, r"local_length '8' is a str"),
        (([3], [1]), {"qkv_format": 3}, TypeError, r"qkv_format must be a str, got an int 3"),
        (([3], [1]), {"cp_mode": None}, TypeError, r"cp_mode must be a str"),
    ],
)
def test_wrong_kinds(args: tuple[Any, ...], kwargs: dict[str, Any], error: type, match: str) -> None:
    with refused(error, match):
        Layout(*args, **kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([3, 4], [1]), {}, r"total_lengths has 2 samples but response_lengths has 1"),
        (([3, 0], [1, 0]), {}, r"sample 1: total_length 0 < 1"),
        (([3, 4], [1, -1]), {}, r"sample 1: response_length -1 < 0"),
        (
            ([3, 8], [1, 8]),
            {},
            r"sample 1: response_length 8 > total_length - 1 = 7 \(a response needs at least "
            r"one prompt token before it\)",
        ),
        (([3], [1]), {"qkv_format": "bshd"}, r"qkv_format 'bshd' needs max_seq_len"),
        (([3, 20], [1, 1]), {"qkv_format": "bshd", "max_seq_len": 16},
         r"sample 1: total_length 20 > max_seq_len 16"),
        (([3], [1]), {"max_seq_len": 16}, r"max_seq_len=16 is given with qkv_format 'thd'"),
        (([3], [1]), {"qkv_format": "sbhd"}, r"qkv_format 'sbhd' is not one of \('thd', 'bshd'\)"),
        (([3], [1]), {"cp_mode": "ring"}, r"cp_mode 'ring' is not one of"),
        (([3], [1]), {"cp_mode": "zigzag", "cp_size": 2, "cp_rank": 2},
         r"cp_rank 2 is outside \[0, cp_size=2\)"),
        (([3], [1]), {"cp_mode": "zigzag", "cp_size": 2, "cp_rank": -1}, r"cp_rank -1 is outside"),
        (([3], [1]), {"cp_mode": "zigzag", "cp_size": 0}, r"cp_size 0 < 1"),
        (([3], [1]), {"cp_size": 2}, r"cp_mode 'none' with cp_size 2: pass cp_mode='zigzag'"),
        (([3], [1]), {"cp_mode": "zigzag"}, r"^cp_mode 'zigzag' with cp_size 1: zigzag needs cp_size 2 or more "
         r"\(it deals each sample's 2 \* cp_size chunks out to the CP ranks in pairs\); pass cp_mode='none' for one "
         r"rank$"),
        (([3], [1]), {"cp_mode": "zigzag", "qkv_format": "bshd", "max_seq_len": 4, "cp_size": 1},
         r"cp_mode 'zigzag' with cp_size 1"),
        (([3], [1]), {"cp_mode": "allgather", "qkv_format": "bshd", "max_seq_len": 4,
                      "cp_size": 2}, r"cp_mode 'allgather' .* needs qkv_format 'thd'"),
        (([3], [1]), {"local_length": -1}, r"local_length -1 < 0"),
    ],
)
def test_bad_layouts(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    with refused(LayoutError, match):
        Layout(*args, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cp_mode": "allgather", "cp_size": 2, "local_length": 4},
         r"cp_size \* T = 2 \* 4 = 8 < sum\(total_lengths\) = 10"),
        ({"local_length": 9}, r"local_length 9 is too short: the layout needs at least 10 positions"),
    ],
)
def test_a_short_local_length_is_refused_where_it_is_read(kwargs: dict[str, Any], match: str) -> None:
    # A Layout is a record; the plan that reads it refuses a local_length too short.
    layout = Layout([10], [4], **kwargs)
    with refused(LayoutError, match):
        shard_responses([torch.zeros(4)], layout)
    with refused(LayoutError, match):
        pack([torch.zeros(10)], layout)


@pytest.mark.parametrize(
    ("size", "cp_mode", "error", "match"),
    [
        (1, "zigzag", LayoutError, r"cp_mode 'zigzag' but megatron-core's context-parallel world "
         r"size is 1: pass cp_mode='none' \(or None, which reads it from parallel_state\)"),
        (4, "none", LayoutError, r"cp_mode 'none' but megatron-core's context-parallel world "
         r"size is 4: pass cp_mode='zigzag' or 'allgather' \(or None, which reads 'zigzag'"),
        (4, "ring", LayoutError, r"cp_mode 'ring' is not one of"),
        (4, True, TypeError, r"cp_mode must be a str, got a bool True"),
        (1, "allgather", LayoutError, r"cp_mode 'allgather' .* needs qkv_format 'thd'"),
    ],
)
def test_from_parallel_state_checks_cp_mode_against_the_cp_size(
    size: int, cp_mode: Any, error: type, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # megatron-core's parallel_state (the environment) as CP rank size - 1 of size would
    # read it (test_end_to_end reads a real one); megatron-core first, outside jaxtyping's hook
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: size - 1)
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: size)
    with refused(error, match):
        Layout.from_parallel_state([10], [4], cp_mode=cp_mode, qkv_format="bshd", max_seq_len=12)


def test_numpy_integers_ranges_and_reals_are_accepted() -> None:
    plain = Layout([10, 6], [4, 2], cp_mode="zigzag", cp_rank=1, cp_size=2, local_length=12)
    numpy = Layout(np.array([10, 6]).tolist(), (np.int64(4), np.int32(2)), cp_mode="zigzag",
                   cp_rank=np.int64(1), cp_size=np.int8(2), local_length=np.uint16(12))
    assert numpy == plain and type(numpy.cp_rank) is int and type(numpy.total_lengths[0]) is int
    assert Layout(range(3, 5), range(1, 3)) == Layout([3, 4], [1, 2])
    assert plain.for_rank(np.int64(0)) == plain.for_rank(0)
    logits = torch.randn(4, 7)
    targets = torch.tensor([1, 2, 3, 4])
    expected, _ = log_probs_and_entropy(logits, targets, temperature=0.5, chunk_size=2)
    got, _ = log_probs_and_entropy(logits, targets, temperature=np.float32(0.5),
                                   chunk_size=np.int64(2))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    ("dtype", "fill", "error", "match"),
    [
        (torch.int64, 0.5, LayoutError, r"fill 0\.5 cannot be held by torch\.int64"),
        (torch.int64, float("nan"), LayoutError, r"fill nan cannot be held by torch\.int64"),
        (torch.int64, float("inf"), LayoutError, r"cannot be held"),
        (torch.uint8, 300, LayoutError, r"fill 300 is outside the range of torch\.uint8"),
        (torch.bool, 2, LayoutError, r"fill 2 cannot be held by a bool tensor"),
        (torch.int64, "0", TypeError, r"fill must be a real number, got a str"),
        (torch.float32, None, TypeError, r"fill must be a real number"),
    ],
)
def test_pack_refuses_a_fill_its_dtype_cannot_hold(
    dtype: torch.dtype, fill: Any, error: type, match: str
) -> None:
    layout = Layout([3, 2], [1, 1], cp_mode="zigzag", cp_size=2)
    with refused(error, match):
        pack([torch.zeros(3, dtype=dtype), torch.zeros(2, dtype=dtype)], layout, fill=fill)


def test_pack_keeps_an_exact_fill() -> None:
    layout = Layout([3, 2], [1, 1], cp_mode="zigzag", cp_size=2)
    tokens = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    assert pack(tokens, layout, fill=-1.0).tolist() == [5, -1, 8, -1]
    assert pack(tokens, layout, fill=np.int64(2**40))[1].item() == 2**40
    assert shifted_targets(tokens, layout, fill=np.int32(-7)).tolist() == [6, -7, 9, -7]


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64],
                         ids=str)
def test_pack_takes_a_fill_at_its_dtypes_limits_and_refuses_one_beyond(dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    layout = Layout([3, 2], [1, 1], cp_mode="zigzag", cp_size=2)
    tokens = [torch.tensor([5, 6, 7], dtype=dtype), torch.tensor([8, 9], dtype=dtype)]
    for fill in (info.min, info.max):  # the limits themselves are held exactly
        out = pack(tokens, layout, fill=fill)
        assert out.dtype == dtype and out.tolist() == [5, fill, 8, fill], fill
    for fill in (info.min - 1, info.max + 1):
        with refused(LayoutError, rf"fill {fill} is outside the range of {re.escape(str(dtype))} "
                     rf"\[{info.min}, {info.max}\]"):
            pack(tokens, layout, fill=fill)


def test_layout_error_is_a_value_error() -> None:
    assert issubclass(LayoutError, ValueError)


def test_a_layout_is_immutable_and_hashable() -> None:
    layout = Layout([3, 4], [1, 2])
    with pytest.raises(AttributeError):
        layout.cp_rank = 1
    assert layout == Layout((3, 4), (1, 2)) and hash(layout) == hash(Layout((3, 4), (1, 2)))
    assert layout != layout.with_local_length(7)


def test_values_errors() -> None:
    layout = Layout([10], [4], cp_mode="zigzag", cp_size=2)
    with refused(LayoutError, r"values has length 5, which is too short: the layout needs "
                 r"at least 6 positions \(zigzag layout\)"):
        extract_responses(torch.zeros(5), layout)
    with refused(TypeError, r"values has dtype torch\.int64; per-position results .* must be "
                 "floating point"):
        extract_responses(torch.zeros(6, dtype=torch.int64), layout)
    with refused(TypeError, r"values is 0-d"):
        extract_responses(torch.tensor(1.0), layout)
    with refused(TypeError, r"values must be a torch\.Tensor \[T, \.\.\.\], got a list"):
        extract_responses([1.0] * 6, layout)  # type: ignore[call-overload]
    with refused(LayoutError, r"entropy has shape \(6, 2\) but values has \(6,\) \(they must be "
                 r"aligned position by position\)"):
        extract_responses(torch.zeros(6), layout, torch.zeros(6, 2))
    with refused(LayoutError, r"entropy has shape \(6,\) but values has \(6, 1\)"):
        extract_responses(torch.zeros(6, 1), layout, torch.zeros(6))
    fixed = Layout([10], [4], cp_mode="zigzag", cp_size=2, local_length=8)
    with refused(LayoutError, r"values has length 7 but the layout's local_length is 8"):
        extract_responses(torch.zeros(7), fixed)
    short = Layout([10, 10], [4, 4], cp_mode="allgather", cp_size=2)
    with refused(LayoutError, r"2 \* 9 = 18 < sum\(total_lengths\) = 20"):
        extract_responses(torch.zeros(9), short)


def test_shard_errors() -> None:
    layout = Layout([10, 6], [4, 2])
    with refused(LayoutError, r"full has 1 samples but the layout has 2"):
        shard_responses([torch.zeros(4)], layout)
    with refused(LayoutError, r"sample 1: full\[1\] has 3 positions but response_length is 2"):
        shard_responses([torch.zeros(4), torch.zeros(3)], layout)
    with refused(TypeError, r"full must be a list of per-sample tensors, got a Tensor"):
        shard_responses(torch.zeros(6), layout)  # type: ignore[arg-type]
    with refused(TypeError, r"sample 1: full\[1\] must be a tensor .*, got a list"):
        shard_responses([torch.zeros(4), [0.0, 0.0]], layout)  # type: ignore[list-item]
    allgather = Layout([10, 6], [4, 2], cp_mode="allgather", cp_size=2)
    with refused(LayoutError, r"build the Layout with local_length=T"):
        shard_responses([torch.zeros(4), torch.zeros(2)], allgather)


def test_response_log_probs_errors() -> None:
    layout = Layout([4], [2])
    tokens = [torch.arange(4)]
    with refused(TypeError, r"logits must be a torch\.Tensor \[T, V_local\], got a list"):
        response_log_probs([[0.0] * 5] * 4, tokens, layout)  # type: ignore[call-overload]
    with refused(LayoutError, r"logits has shape \(4,\); it must be 2-D"):
        response_log_probs(torch.zeros(4), tokens, layout)
    with refused(TypeError, r"logits must be a torch\.Tensor"):
        log_probs_and_entropy([[0.0]], torch.zeros(1, dtype=torch.int64))  # type: ignore[call-overload]


def test_reducers_name_a_non_tensor_share() -> None:
    layout = Layout([3], [2])
    for reducer in (sum_of_sample_means, sum_of_tokens):
        with refused(TypeError, r"values\[0\] must be a tensor .*, got a list"):
            reducer([[1.0, 2.0]], [torch.ones(2)], layout)  # type: ignore[list-item]
        with refused(TypeError, r"values must be a list of per-sample tensors, got a Tensor"):
            reducer(torch.ones(2), [torch.ones(2)], layout)  # type: ignore[arg-type]


def test_redistribute_refuses_other_samples_before_any_collective() -> None:
    # cp_size 1: no process group exists in this test, so a refusal must come first.
    src = Layout([10, 6], [4, 2])
    shares = [torch.zeros(4), torch.zeros(2)]
    with refused(LayoutError, r"src has response_lengths \[4, 2\] but dst has \[4, 3\]"):
        redistribute(shares, src, Layout([10, 6], [4, 3]))
    with refused(LayoutError, r"src has total_lengths \[10, 6\] but dst has \[10, 7\]"):
        redistribute(shares, src, Layout([10, 7], [4, 2]))
    with refused(LayoutError, r"sample 1: values\[1\] has 3 positions but rank 0's share in src "
                 r"is 2"):
        redistribute([torch.zeros(4), torch.zeros(3)], src, src)
    with refused(LayoutError, r"sample 1: values\[1\] is torch\.float64 .* \(every share that "
                 r"travels in one call has one dtype and trailing shape\)"):
        redistribute([torch.zeros(4), torch.zeros(2, dtype=torch.float64)], src, src)
    with refused(TypeError, r"values must be a list of per-sample tensors, got a Tensor"):
        redistribute(torch.zeros(6), src, src)  # type: ignore[call-overload]


def test_redistribute_at_cp_size_1_needs_no_process_group() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    zig = Layout([10, 6], [4, 2], cp_mode="allgather", cp_size=1, local_length=16)
    lp = [torch.randn(4, requires_grad=True), torch.randn(2, requires_grad=True)]
    ent = [torch.randn(4), torch.randn(2)]
    out, out_ent = redistribute((lp, ent), zig, Layout([10, 6], [4, 2]))
    assert [x is y for x, y in zip(out + out_ent, lp + ent)] == [True] * 4
    whole = gather_responses(lp, Layout([10, 6], [4, 2]))
    assert whole[0] is lp[0] and whole[1] is lp[1]


def test_error_tests_pass_unchecked() -> None:
    """The error tests again, in a fresh interpreter with run-time checking off: only
    cpslice's own exception type and message pass there, so none of its checks can be
    deleted behind the checker's back; and the argument kinds every entry point accepts
    (test_arguments), which must be the same with checking on and off."""
    if not CHECKED:
        pytest.skip("this is the unchecked run")
    # started with the session, in the background (tests/support/background.py)
    proc = background.result("unchecked", timeout=200)["unchecked"]
    assert proc.code == 0, proc.out[-4000:] + proc.err[-2000:]
    assert " passed" in proc.out and "skipped" in proc.out, proc.out[-500:]
