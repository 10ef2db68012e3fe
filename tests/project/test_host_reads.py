"""tests/support/host_reads.py, the counter of host reads the ``*_reads_a_device_tensor_once``
tests rest on: every route to the host counts, once, through whatever the library
computes from the watched tensor; metadata and device-side work do not."""

import operator
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor

from ..support.host_reads import watch

ROUTES: list[tuple[str, Callable[[Tensor], object]]] = [
    ("tolist", lambda x: x.tolist()),
    ("item", lambda x: x[0].item()),
    ("numpy", lambda x: x.numpy()),
    ("cpu", lambda x: x.cpu()),
    ("to", lambda x: x.to("cpu")),
    ("to", lambda x: x.to(device=torch.device("cpu"))),
    ("to", lambda x: x.to(torch.zeros(1))),
    ("copy_", lambda x: torch.empty(3, dtype=torch.int64).copy_(x)),
    ("__bool__", lambda x: bool(x[0])),
    ("__int__", lambda x: int(x[0])),
    ("__float__", lambda x: float(x[0])),
    ("__index__", lambda x: operator.index(x[0])),
    ("__array__", lambda x: np.asarray(x)),
    ("__repr__", repr),
    ("__contains__", lambda x: 4 in x),
    ("equal", lambda x: torch.equal(x, x)),
    ("nonzero", lambda x: x.nonzero()),
    ("masked_select", lambda x: x.masked_select(x > 1)),
    ("unique", lambda x: torch.unique(x)),
    ("__getitem__", lambda x: x[x > 1]),
    ("__setitem__", lambda x: x.clone().__setitem__(x > 1, 0)),
    ("repeat_interleave", lambda x: x.repeat_interleave(x)),
]


@pytest.mark.parametrize(("name", "route"), ROUTES, ids=[f"{n}{i}" for i, (n, _) in enumerate(ROUTES)])
def test_every_route_to_the_host_counts_once_also_from_a_derived_tensor(
    name: str, route: Callable[[Tensor], object]
) -> None:
    derived: list[Callable[[Tensor], Tensor]] = [lambda x: x, lambda x: (x * 2 + 1).flip(0)]
    for derive in derived:
        x, reads = watch(torch.tensor([0, 4, 20]))
        route(derive(x))
        assert reads == [name]


def test_metadata_and_device_side_work_are_no_reads() -> None:
    x, reads = watch(torch.tensor([[0, 1], [1, 1]]))
    assert x.shape == (2, 2) and x.dim() == 2 and x.numel() == 4 and x.dtype == torch.int64
    assert not x.is_floating_point() and x.device.type == "cpu" and len(x) == 2
    y = torch.stack([x.sum(1), torch.where(x != 0, torch.arange(2), 2).amin(1)], 1)
    y = y.to(torch.int32).gather(1, torch.zeros(2, 1, dtype=torch.int64))[:, 0].long()
    y.repeat_interleave(torch.tensor([1, 1]), output_size=2)
    assert type(y).__name__ == "Watched"  # still watched, its reads counted
    assert reads == []


def test_what_a_host_copy_returns_reads_the_host() -> None:
    x, reads = watch(torch.tensor([1, 2]))
    host = x.cpu()
    assert host.tolist() == [1, 2] and int(host[0]) == 1 and type(host) is Tensor
    assert reads == ["cpu"]
    x.tolist()
    x.tolist()
    assert reads == ["cpu", "tolist", "tolist"]
