"""The module-level caches of cpslice, bounded, registered in one place, clearable.

Every cached function is also a ``torch.compiler.disable`` boundary: the planning
arithmetic (Python ints, ``.tolist()``, data-dependent shapes) is what a compiled
training step should not trace, and the cache is only honoured when the call is not
traced (dynamo would trace through ``lru_cache`` and recompute).

A boundary decides when it is called, not when it is defined, because
``torch.compiler.disable`` imports ``torch._dynamo`` (1.5 s or more, nearly all of
``import cpslice`` when every boundary called it at import). Until something imports
``torch._dynamo`` nothing can be compiling, so the wrapper calls the function directly;
from then on it calls the function's ``torch.compiler.disable`` version, made at its
first such call and kept. Dynamo must never trace the wrapper itself:

- a traced caller would trace into it, and make the disabled version while tracing when
  the boundary's first call is a compiled one: the wrapper carries the attributes that
  torch's own disable wrapper carries, so dynamo breaks the graph at the call ("Skip
  inlining `torch.compiler.disable()`d function") instead;
- the compiled caller then calls it as Python, and dynamo would trace that frame as a
  frame of its own (torch's wrapper escapes this by living in ``torch._dynamo``), its
  one code object shared by every boundary running into the recompile limit: the code
  is marked, once, for dynamo's frame evaluator as a frame to run untraced. Its callees
  are not skipped: the disabled version keeps dynamo out of the planning code, as before.

The graph breaks of a compiled step are where they were (tests/glue/test_compile.py).
Where this torch offers no such mark, every boundary is ``torch.compiler.disable`` at
definition, as before: correct, and slow to import.

A training step reads a handful of layouts (this rank's, perhaps one with another
``local_length``, the destination of a ``redistribute``), each for a few spans and on
one device; every cache below holds about that much, so repeated steps with the same
layouts neither recompute the index arithmetic nor copy an index to the device again,
and a new batch's layouts push the old ones out. ``clear_caches()`` empties them all.
"""

import functools
import sys
import types
from collections.abc import Callable
from typing import Any, TypeVar, cast, no_type_check

import torch

_F = TypeVar("_F", bound=Callable[..., Any])
_CACHES: list[Any] = []

_DYNAMO = "torch._dynamo"
_REASON = "cpslice planning: index arithmetic on the host, run eagerly"


def cached(maxsize: int) -> Callable[[_F], _F]:
    """``functools.lru_cache(maxsize)``, registered so that ``clear_caches`` empties it,
    behind a ``torch.compiler.disable`` boundary (see the module docstring)."""

    def wrap(fn: _F) -> _F:
        wrapped = functools.lru_cache(maxsize=maxsize)(fn)
        _CACHES.append(wrapped)
        return boundary(cast(_F, wrapped))  # lru_cache keeps the signature

    return wrap


def _disable(fn: _F) -> _F:
    """``torch.compiler.disable(fn)`` (which imports ``torch._dynamo``)."""
    disable = cast(Callable[[_F], _F], torch.compiler.disable)  # untyped in torch
    return disable(fn)


# Excluded from debug mode's import hook (no_type_check): a checker's wrapper around
# ``call`` would be what callers call, and its code (jaxtyping's) the one marked below.
@no_type_check
def _lazy(fn):
    """``fn`` behind a boundary that imports nothing (the module docstring)."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _DYNAMO not in sys.modules:  # no compiler loaded: nobody is tracing this call
            return fn(*args, **kwargs)
        nonlocal disabled
        if disabled is None:  # the first call since torch._dynamo was imported
            # torch's function called from here, no frame of cpslice's between: a call
            # from compiled code runs this frame untraced, but its callees are not
            # skipped, and dynamo would trace a cpslice helper's call of it
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    # what torch.compiler.disable's wrapper carries: a traced caller breaks its graph
    # here ("Skip inlining `torch.compiler.disable()`d function") instead of tracing in
    call._torchdynamo_disable = True
    call._torchdynamo_disable_msg = _REASON
    return call


def _skip_frames_of(code: types.CodeType) -> bool:
    """Mark ``code`` for dynamo's frame evaluator: a frame of it runs as plain Python,
    never traced, its callees as usual (what ``torch._dynamo``'s ``skip_code`` does, in
    torch's C extension, loaded with torch: nothing is imported); False where this torch
    has no such switch."""
    try:
        from torch._C._dynamo import eval_frame as ef

        ef.set_code_exec_strategy(
            code, ef._FrameExecStrategy(ef._FrameAction.SKIP, ef._FrameAction.DEFAULT)
        )
    except (ImportError, AttributeError, TypeError):  # another torch: no lazy boundary
        return False
    return True


# Every boundary's wrapper is a closure of one code object: marked once, here.
_LAZY = _skip_frames_of(_lazy(len).__code__)


def boundary(fn: _F) -> _F:
    """``torch.compiler.disable``, decided at each call (the module docstring): a
    compiled caller runs ``fn`` eagerly (one graph break) instead of tracing its index
    arithmetic; an eager caller, before anything imported ``torch._dynamo``, calls
    ``fn`` through one Python function and a ``sys.modules`` lookup."""
    return cast(_F, _lazy(fn)) if _LAZY else _disable(fn)


def clear_caches() -> None:
    """Empty every cache of cpslice (layout plans, device copies of indices, routes).

    Nothing needs it for correctness: every cache is keyed by immutable layouts and
    devices. Call it to release the memory the last batch's index tensors hold (a few
    bytes per token), e.g. before a phase that uses other layouts.
    """
    for cache in _CACHES:
        cache.cache_clear()


def cache_sizes() -> dict[str, int]:
    """How many entries each registered cache holds now (for debugging: what the caches hold)."""
    return {f"{c.__module__}.{c.__qualname__}": c.cache_info().currsize for c in _CACHES}


def cache_info(fn: Callable[..., Any]) -> Any:
    """``functools``' cache info of a function decorated with ``cached`` (through any
    wrapper: the compiler boundary, debug mode's checker)."""
    while not hasattr(fn, "cache_info"):
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    return fn.cache_info()
