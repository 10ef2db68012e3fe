"""The host reads of a tensor, counted on any device: ``watch(x)`` gives ``x`` as a tensor
subclass whose every operation's result is watched too (so what the library computes
from it counts as well), and the list each host read of them appends its name to.

A host read is what, on a device, copies values to the host and waits for them:
``.tolist()``, ``.item()``, ``.numpy()``, ``.cpu()``, ``.to()`` the host (or a host
tensor), ``copy_`` into a host tensor, ``bool()``, ``int()``, ``float()``,
``operator.index()``, ``in``, ``torch.equal`` and the like, formatting; and the
operations whose result's size depends on the values (``nonzero``, ``masked_select``,
``unique``, indexing with a boolean mask, ...), which wait for them too. What a host
copy returns is a plain tensor: reading it again reads the host.

``host_syncs(device)`` counts the synchronizations CUDA itself reports (its sync debug
mode), and nothing elsewhere; ``read_once`` asserts one of each around a call, on every
device of ``DEVICES`` (CUDA skipped without one)."""

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
import torch
from torch import Tensor

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                              reason="no CUDA device"))]
R = TypeVar("R")

READS = frozenset({
    "tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__complex__",
    "__array__", "__format__", "__repr__", "__contains__", "is_nonzero", "equal", "allclose",
})
SIZED_BY_VALUES = frozenset({
    "nonzero", "nonzero_static", "argwhere", "masked_select", "unique", "unique_consecutive", "_unique2",
    "bincount", "repeat_interleave",
})
COPIES = frozenset({"cpu", "numpy", "tolist", "to", "copy_"})  # their results are the host's


def _on_host(value: object) -> bool:
    if isinstance(value, (str, torch.device)):
        return torch.device(value).type == "cpu"
    return False


def _is_read(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], watched: type) -> bool:
    if name in READS or name in SIZED_BY_VALUES:
        return not (name == "repeat_interleave" and kwargs.get("output_size") is not None)
    if name == "to":  # to the host device, or to a host tensor's device and dtype
        rest = [*args[1:], kwargs.get("device")]
        return any(_on_host(a) or isinstance(a, Tensor) and not isinstance(a, watched) for a in rest)
    if name == "copy_":  # a watched tensor's values into a host one
        return not isinstance(args[0], watched) and isinstance(args[1], watched)
    if name in ("__getitem__", "__setitem__"):  # a boolean mask picks a count of its values
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in index)
    return False


def watch(tensor: Tensor) -> tuple[Tensor, list[str]]:
    """``tensor`` as a watched tensor, and the list of the host reads of it and of every
    tensor computed from it (their names, in order)."""
    reads: list[str] = []

    class Watched(Tensor):
        @classmethod
        def __torch_function__(
            cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            read = _is_read(name, args, kwargs, cls)
            if read:
                reads.append(name)
            out = super().__torch_function__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
            if read and name in COPIES and isinstance(out, Tensor):
                with torch._C.DisableTorchFunctionSubclass():
                    out = out.as_subclass(Tensor)
            return out

    return tensor.as_subclass(Watched), reads


@contextmanager
def host_syncs(device: str) -> Iterator[list[str]]:
    """The messages of the synchronizations a CUDA device reports within (none off CUDA)."""
    found: list[str] = []
    if torch.device(device).type != "cuda":
        yield found
        return
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(before)
    found.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))


def read_once(call: Callable[[Tensor], R], tensor: Tensor) -> R:
    """``call`` of ``tensor`` watched, asserting that it reads the host once (on CUDA:
    and that the device reports one synchronization); what it returns."""
    watched, reads = watch(tensor)
    with host_syncs(str(tensor.device)) as syncs:
        out = call(watched)
    assert len(reads) == 1, reads
    assert len(syncs) == (tensor.device.type == "cuda"), syncs
    return out
