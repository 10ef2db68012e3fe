"""The module-level caches of cpslice, bounded, registered in one place, clearable.

Every cached function is also a ``torch.compiler.disable`` boundary: the planning
arithmetic (Python ints, ``.tolist()``, data-dependent shapes) is what a compiled
training step should not trace, and the cache is only honoured when the call is not
traced (dynamo would trace through ``lru_cache`` and recompute).

A training step reads a handful of layouts (this rank's, perhaps one with another
``local_length``, the destination of a ``redistribute``), each for a few spans and on
one device; every cache below holds about that much, so repeated steps with the same
layouts neither recompute the index arithmetic nor copy an index to the device again,
and a new batch's layouts push the old ones out. ``clear_caches()`` empties them all.
"""

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

_F = TypeVar("_F", bound=Callable[..., Any])
_CACHES: list[Any] = []


def cached(maxsize: int) -> Callable[[_F], _F]:
    """``functools.lru_cache(maxsize)``, registered so that ``clear_caches`` empties it,
    behind a ``torch.compiler.disable`` boundary (see the module docstring)."""

    def wrap(fn: _F) -> _F:
        wrapped = functools.lru_cache(maxsize=maxsize)(fn)
        _CACHES.append(wrapped)
        return boundary(cast(_F, wrapped))  # lru_cache keeps the signature

    return wrap


def boundary(fn: _F) -> _F:
    """``torch.compiler.disable``: a compiled caller runs ``fn`` eagerly (one graph
    break) instead of tracing its index arithmetic."""
    disable = cast(Callable[[_F], _F], torch.compiler.disable)  # untyped in torch
    return disable(fn)


def clear_caches() -> None:
    """Empty every cache of cpslice (layout plans, device copies of indices, routes).

    Nothing needs it for correctness: every cache is keyed by immutable layouts and
    devices. Call it to release the memory the last batch's index tensors hold (a few
    bytes per token), e.g. before a phase that uses other layouts.
    """
    for cache in _CACHES:
        cache.cache_clear()


def cache_sizes() -> dict[str, int]:
    """How many entries each registered cache holds now (for tests and debugging)."""
    return {f"{c.__module__}.{c.__qualname__}": c.cache_info().currsize for c in _CACHES}


def cache_info(fn: Callable[..., Any]) -> Any:
    """``functools``' cache info of a function decorated with ``cached`` (through any
    wrapper: the compiler boundary, debug mode's checker)."""
    while not hasattr(fn, "cache_info"):
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    return fn.cache_info()
