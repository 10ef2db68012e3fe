"""Every bad input gets a LayoutError or TypeError naming the sample, values and rule."""

from typing import Any

import pytest
import torch

from cpslice import Layout, LayoutError, extract_responses, shard_responses


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([3, 4], [1]), {}, r"total_lengths has 2 samples but response_lengths has 1"),
        (([3, 4.0], [1, 1]), {}, r"sample 1: total_length 4\.0 is a float, not an int"),
        (([3, True], [1, 0]), {}, r"sample 1: total_length True is a bool, not an int"),
        (([3, 4], [1, 1.0]), {}, r"sample 1: response_length 1\.0 is a float"),
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
        (([3], [1]), {"cp_mode": "allgather", "qkv_format": "bshd", "max_seq_len": 4,
                      "cp_size": 2}, r"cp_mode 'allgather' .* needs qkv_format 'thd'"),
        ((torch.tensor([3]), [1]), {}, r"total_lengths must be a list or tuple of ints, got a "
         r"Tensor \(call \.tolist\(\) on it first\)"),
        (([10], [4]), {"cp_mode": "allgather", "cp_size": 2, "local_length": 4},
         r"cp_size \* T = 2 \* 4 = 8 < sum\(total_lengths\) = 10"),
        (([10], [4]), {"local_length": 9}, r"local_length 9 is too short: the layout needs at least 10 positions"),
    ],
)
def test_bad_layouts(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        Layout(*args, **kwargs)


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
    with pytest.raises(LayoutError, match=r"values has length 5, which is too short: the layout needs "
                       r"at least 6 positions \(zigzag layout\)"):
        extract_responses(torch.zeros(5), layout)
    with pytest.raises(TypeError, match=r"must be floating point|Float\[Tensor"):
        extract_responses(torch.zeros(6, dtype=torch.int64), layout)
    with pytest.raises(TypeError):
        extract_responses(torch.tensor(1.0), layout)
    with pytest.raises(TypeError):
        extract_responses([1.0] * 6, layout)  # type: ignore[call-overload]
    with pytest.raises((LayoutError, TypeError), match=r"shape|entropy"):
        extract_responses(torch.zeros(6), layout, torch.zeros(6, 2))
    fixed = Layout([10], [4], cp_mode="zigzag", cp_size=2, local_length=8)
    with pytest.raises(LayoutError, match=r"values has length 7 but the layout's local_length is 8"):
        extract_responses(torch.zeros(7), fixed)
    short = Layout([10, 10], [4, 4], cp_mode="allgather", cp_size=2)
    with pytest.raises(LayoutError, match=r"2 \* 9 = 18 < sum\(total_lengths\) = 20"):
        extract_responses(torch.zeros(9), short)


def test_shard_errors() -> None:
    layout = Layout([10, 6], [4, 2])
    with pytest.raises(LayoutError, match=r"full has 1 samples but the layout has 2"):
        shard_responses([torch.zeros(4)], layout)
    with pytest.raises(LayoutError, match=r"sample 1: full\[1\] has 3 positions but "
                       r"response_length is 2"):
        shard_responses([torch.zeros(4), torch.zeros(3)], layout)
    with pytest.raises(TypeError, match=r"list of per-sample tensors|parameter .full."):
        shard_responses(torch.zeros(6), layout)  # type: ignore[arg-type]
    allgather = Layout([10, 6], [4, 2], cp_mode="allgather", cp_size=2)
    with pytest.raises(LayoutError, match=r"build the Layout with local_length=T"):
        shard_responses([torch.zeros(4), torch.zeros(2)], allgather)
