"""Per-chunk log-prob kernels, eager or compiled by ``torch.compile`` (``CPSLICE_COMPILE``).

Two pure functions of one row chunk ``x = logits[s:e]`` (``[n, V_local]``, any float
dtype; arithmetic in float32, float64 for float64 logits), with ``inv_tau`` the
inverse temperature as a 0-d tensor (a multiply where the eager loop divides: within
an ulp, and a vector division costs as much as the exp):

- ``chunk_stats(x, inv_tau) -> (m, S, A)``, each ``[n]``: the row max ``m``,
  ``S = sum exp(d)`` and ``A = sum exp(d) * d`` with ``d = (x - m) / tau`` clamped at
  ``FLOOR`` (an all -inf row has ``m = -inf`` and ``S = A = 0``);
- ``chunk_grad(x, m, log_s, inv_tau, a, b, out)`` writes into ``out`` (``[n,
  V_local]``, dtype of ``x``) ``p * (a * log p + b)``, with ``log p = (x - m) / tau -
  log_s`` clamped at ``FLOOR`` and ``a, b`` per-row ``[n]`` coefficients, rounded once.
  The one-hot term of the target column is not in the loop: ``grad`` overwrites that
  one entry per row afterwards (``target_grad``), also rounded once.

Called eagerly they are plain torch code (temporaries of one chunk); compiled, each
is one fused loop over the chunk: one read of the logits in forward, one read and
one write in backward. ``stats`` and ``grad`` below run them over all rows of a
``[T, V_local]`` tensor with a *fixed* chunk shape: full chunks of ``C`` rows, the
tail as one more chunk of ``C`` rows ending at row ``T`` (overlapping the previous
chunk, whose rows it recomputes to the same values), and for ``T < C`` the largest
power of two ``<= T`` in the same way. A new ``T`` therefore compiles nothing new;
each (kernel, dtype, V_local, chunk rows, device type) is compiled once per process,
in a code object of its own so that dynamo's per-function recompile limit never
silently turns a variant eager. Temperature, TP offset and per-row coefficients are
tensor inputs (the target column never enters a kernel); ``chunk_stats`` always
computes ``A`` (with or without entropy: one variant, the extra multiply-add is free
in a fused loop).

The compiled functions carry no jaxtyping annotations and are excluded from the
debug-mode import hook (``typing.no_type_check``): dynamo traces plain torch code.
"""

import ctypes
import functools
import math
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any, cast, no_type_check

import torch
from torch import Tensor

MODES = ("auto", "1", "0")
FLOOR = -1.0e4
"""exp() of anything below this is exactly 0 in float32 and float64 (see _logprob)."""

CPU_COMPILED_CHUNK_BYTES = 32 * 2**20
COMPILED_CHUNK_BYTES = 2**30
"""Rows per compiled chunk: ``[C, V_local]`` of the compute dtype within these bytes
(CPU / other devices), rounded down to a power of two. A compiled chunk needs no work
buffer, so the size only trades per-call overhead (and, on a GPU, occupancy) against
the redundant overlap of the tail chunk: on a GPU a chunk of a few hundred rows of a
large vocabulary would leave most of the device idle (one row per program)."""
AUTO_MIN_ELEMENTS = 2**22
"""In ``auto``, the compiled kernels run only for ``T * V_local`` at least this (about
16 MiB of float32 logits): below it the eager kernels cost little and a first compile
(seconds) would not pay for itself."""
BACKEND = "inductor"
"""The ``torch.compile`` backend; tests of the chunk plumbing may set ``aot_eager``."""


def compile_mode() -> str:
    """``CPSLICE_COMPILE``: ``auto`` (unset or empty too), ``1`` or ``0``.

    Raises:
        ValueError: any other value; the message lists the valid ones.
    """
    value = os.environ.get("CPSLICE_COMPILE", "") or "auto"
    if value not in MODES:
        raise ValueError(
            f"CPSLICE_COMPILE={value!r} is not valid; use one of: unset or '' or 'auto' "
            "(compiled kernels when the work is large enough and the compiler works), "
            "'1' (always compiled; an error if torch.compile fails), '0' (never)"
        )
    return value


mode = compile_mode()
"""Read once, at import. Tests may assign another of ``MODES``."""
_broken: str | None = None  # the first compile failure in auto mode, after its warning
_compiled: dict[tuple[object, ...], Callable[..., Any]] = {}
_ready: set[tuple[object, ...]] = set()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@no_type_check
def chunk_stats(x, inv_tau):
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(cdt)
    m = xf.amax(1)
    shift = torch.where(m == -math.inf, 0.0, m)
    d = ((xf - shift[:, None]) * inv_tau).clamp(min=FLOOR)
    p = torch.exp(d)
    return m, p.sum(1), (p * d).sum(1)


@no_type_check
def chunk_grad(x, m, log_s, inv_tau, a, b, out):
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    d = ((x.to(cdt) - m[:, None]) * inv_tau - log_s[:, None]).clamp(min=FLOOR)
    p = torch.exp(d)
    out.copy_((p * (a[:, None] * d + b[:, None])).to(out.dtype))


def target_grad(
    x: Tensor, m: Tensor, log_s: Tensor, tau: float, a: Tensor | None, b: Tensor, onehot: Tensor
) -> Tensor:
    """``chunk_grad``'s value at one column per row plus the one-hot term, from that
    column's logits ``x`` (``[T]``), in the compute dtype of ``b``: the entry the
    kernels leave out (a per-column compare in the fused loop costs a third of it)."""
    d = ((x.to(b.dtype) - m) / tau - log_s).clamp(min=FLOOR)
    factor = b if a is None else a * d + b
    return torch.exp(d) * factor + onehot


HUGE_PAGE = 2**21
MADV_HUGEPAGE = 14
ADVISE_MIN_BYTES = 32 * 2**20


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` on Linux, else None."""
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], fn)


def buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, zero: bool) -> Tensor:
    """A new (zeroed if ``zero``) tensor for the backward's ``[T, V_local]`` gradient.

    A fresh CPU buffer of hundreds of MiB is new memory from the kernel: its first
    write takes one page fault per 4 KiB page, which at ``T = 4096, V = 32768`` costs
    more than the fused gradient kernel itself. On Linux a CPU buffer of at least
    ``ADVISE_MIN_BYTES`` is therefore advised as transparent huge pages (``madvise
    MADV_HUGEPAGE`` on its 2 MiB-aligned interior) before it is touched: 512 times
    fewer faults where the system's THP setting is ``madvise`` or ``always``, nothing
    where it is ``never``. Advice only: the memory, its size and its contents are what
    ``torch.empty`` gave, and the advice leaves with the memory when it is freed."""
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    madvise = _madvise() if out.device.type == "cpu" and nbytes >= ADVISE_MIN_BYTES else None
    if madvise is not None:
        start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (out.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, MADV_HUGEPAGE)  # a refusal (EINVAL) changes nothing
    return out.zero_() if zero else out


def compiled_chunk_rows(
    vocab: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> int:
    """Rows ``C`` of a compiled chunk: ``[C, vocab]`` of the compute dtype within
    ``CPU_COMPILED_CHUNK_BYTES`` on the CPU, ``COMPILED_CHUNK_BYTES`` elsewhere,
    rounded down to a power of two; at least 1."""
    budget = CPU_COMPILED_CHUNK_BYTES if torch.device(device).type == "cpu" else COMPILED_CHUNK_BYTES
    itemsize = torch.empty((), dtype=_compute_dtype(dtype)).element_size()
    rows = max(1, budget // (max(vocab, 1) * itemsize))
    return 1 << (rows.bit_length() - 1)


def chunk_starts(rows: int, chunk: int) -> tuple[int, list[int]]:
    """``(c, starts)``: the fixed chunk rows used for ``rows`` rows (``chunk``, or for
    fewer rows the largest power of two ``<= rows``) and the first row of each chunk;
    the last chunk ends at ``rows`` and may overlap the one before it."""
    if rows <= 0:
        return chunk, []
    c = chunk if rows >= chunk else 1 << (rows.bit_length() - 1)
    starts = list(range(0, rows - c + 1, c))
    if starts[-1] + c < rows:
        starts.append(rows - c)
    return c, starts


def use_compiled(logits: Tensor) -> bool:
    """Whether ``stats``/``grad`` run the compiled kernels for these logits: always in
    mode ``1``; never in ``0``; in ``auto`` when no compile has failed, the logits are
    contiguous and ``T * V_local >= AUTO_MIN_ELEMENTS``."""
    if mode == "0" or logits.shape[0] == 0:
        return False
    if mode == "1":
        return True
    return (
        _broken is None
        and logits.is_contiguous()
        and logits.numel() >= AUTO_MIN_ELEMENTS
        and not torch.compiler.is_compiling()
    )


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with a code object of its own: dynamo keeps its cache, and its
    recompile limit, per code object, so each variant gets exactly one entry."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _kernel(fn: Callable[..., Any], x: Tensor) -> tuple[tuple[object, ...], Callable[..., Any]]:
    key = (fn.__name__, x.dtype, x.shape[0], x.shape[1], x.stride(), x.device.type, BACKEND)
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = torch.compile(_own_code(fn), backend=BACKEND, dynamic=False, fullgraph=True)
        _compiled[key] = compiled
    return key, compiled


def _reason(error: BaseException) -> str:
    """The innermost cause of a compile failure, on one line (dynamo wraps a backend's
    error in a BackendCompilerFailed with several lines of advice)."""
    inner = getattr(error, "inner_exception", None) or error.__cause__
    if isinstance(inner, BaseException) and inner is not error:
        return _reason(inner)
    first = str(error).strip().splitlines()
    return f"{type(error).__name__}: {first[0] if first else ''}"


def call(fn: Callable[..., Any], x: Tensor, *args: object) -> tuple[bool, object]:
    """``(True, result)`` of the compiled ``fn`` (``chunk_stats`` or ``chunk_grad``) on
    one chunk ``x`` of a fixed shape; ``(False, None)`` if its first call (the
    compilation) failed in ``auto``, which warns once and turns ``auto`` eager. For
    other chunk loops too (e.g. logits computed chunk by chunk from hidden states);
    check ``use_compiled`` first."""
    global _broken
    key, compiled = _kernel(fn, x)
    if key in _ready:
        return True, compiled(x, *args)
    try:
        result = compiled(x, *args)
    except Exception as error:
        if mode == "1":
            raise RuntimeError(
                f"CPSLICE_COMPILE=1 but torch.compile of cpslice's {fn.__name__} failed for "
                f"{x.dtype} [{x.shape[0]}, {x.shape[1]}] logits on {x.device.type} "
                f"({_reason(error)}); set CPSLICE_COMPILE=auto (falls back "
                "to eager) or 0"
            ) from error
        _broken = _reason(error)
        warnings.warn(
            f"cpslice: torch.compile of the log-prob kernels failed ({_broken}); using the "
            "eager kernels from now on (CPSLICE_COMPILE=0 skips compiling, =1 makes this "
            "an error)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False, None
    _ready.add(key)
    return True, result


def stats(logits: Tensor, tau: float, chunk: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(m, S, A)``, each ``[T]`` of the compute dtype, of every row of ``[T, V_local]``
    logits with the compiled ``chunk_stats`` in fixed chunks of ``chunk`` rows; None
    where the compiled kernels are off or failed to compile (run the eager loop)."""
    if not use_compiled(logits):
        return None
    rows = logits.shape[0]
    cdt = _compute_dtype(logits.dtype)
    out = torch.empty((3, rows), dtype=cdt, device=logits.device)
    inv_tau = torch.full((), 1.0 / tau, dtype=cdt, device=logits.device)
    c, starts = chunk_starts(rows, chunk)
    for s in starts:
        ok, result = call(chunk_stats, logits[s : s + c], inv_tau)
        if not ok:
            return None
        for i, r in enumerate(cast(tuple[Tensor, Tensor, Tensor], result)):
            out[i, s : s + c] = r
    return out[0], out[1], out[2]


def grad(
    logits: Tensor,
    m: Tensor,
    log_s: Tensor,
    tau: float,
    a: Tensor | None,
    b: Tensor,
    column: Tensor,
    onehot: Tensor | None,
    chunk: int,
    out: Tensor,
) -> bool:
    """Write ``chunk_grad`` of every row into ``out`` (``[T, V_local]``) with the compiled
    kernel in fixed chunks of ``chunk`` rows, then overwrite each row's ``column`` entry
    with ``target_grad`` (adding ``onehot`` there, rounded once); ``a`` or ``onehot``
    None mean zeros. False (``out`` not fully written) where the compiled kernels are off
    or failed to compile."""
    if not use_compiled(logits):
        return False
    rows = logits.shape[0]
    inv_tau = torch.full((), 1.0 / tau, dtype=b.dtype, device=logits.device)
    a_ = torch.zeros_like(b) if a is None else a
    c, starts = chunk_starts(rows, chunk)
    for s in starts:
        e = s + c
        ok, _ = call(chunk_grad, logits[s:e], m[s:e], log_s[s:e], inv_tau, a_[s:e], b[s:e], out[s:e])
        if not ok:
            return False
    if onehot is not None:
        x = logits.gather(1, column[:, None])[:, 0]
        entry = target_grad(x, m, log_s, tau, a, b, onehot)
        # one entry per row of the contiguous ``out`` by its flat index: a scatter_
        # into a bfloat16 tensor takes a slow path that costs as much as the kernel
        flat = torch.arange(rows, device=out.device) * out.shape[1] + column
        out.view(-1).index_put_((flat,), entry.to(out.dtype))
    return True
