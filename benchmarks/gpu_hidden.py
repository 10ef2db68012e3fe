"""The hidden-state path's benchmark of the GPU command (``benchmarks/gpu_check.py``):
every method of ``gpu_peers.methods`` on ``hidden [T, H]``, ``weight [V, H]`` (bfloat16;
T = 16384, H = 4096, V = 151936 on a GPU), each

- **timed**: the median of ``repeat`` runs (CUDA events), after a check step that holds
  its compiles (Triton's, a peer's autotuning) and a step that measures its memory;
  forward + backward into both inputs, or forward only under ``torch.no_grad()``;
- **against the floor** at the matmul rate measured first (``gemm_floor``: the
  benchmark's own GEMMs through cuBLAS): four GEMMs, ``8 T H V`` flops, for forward +
  backward (the logits, their recomputation, ``d hidden`` and ``d weight``); one,
  ``2 T H V``, forward only;
- **its peak memory beyond the inputs and their gradients**: the allocator's peak during
  one step beyond what was allocated before it, less the two gradients it returns;
- **its error against float64** on ``rows`` rows spread over the batch (``Reference``):
  the log-prob and entropy against the exact float64 softmax of the bfloat16 inputs
  (a bfloat16 GEMM's rounded logits alone account for about ``2^-8`` of the largest
  logit), and ``d hidden``, ``d weight`` relative to their largest entry, from a check
  step whose loss weighs those rows alone;
- **which Triton kernels launched** (``cpslice._probe``'s launch events of the check
  step: a fallback to another backend shows as none).

Inputs: ``hidden`` standard normal, ``weight`` normal scaled so that a logit's standard
deviation is ``LOGIT_STD`` (a peaked softmax, as a language model's), targets drawn from
each row's own softmax (as a rollout's tokens are).
"""

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from cpslice import _probe, backend_for
from cpslice._vocab import blocks
from cpslice._vocab.backends import selection
from cpslice._vocab.backends.triton.interpreter import interpreted

from .gpu_device import Deadline, Device, OverBudget
from .gpu_peers import Method, methods

LOGIT_STD = 4.0
"""A logit's standard deviation: the largest of 151936 about 18, the softmax peaked."""
CHUNK = 16384
"""Columns per float64 piece of the reference (``[rows, CHUNK]`` and ``[CHUNK, H]``)."""


class Sizes(NamedTuple):
    """The benchmark's shapes and effort."""

    t: int
    h: int
    v: int
    rows: int
    """Rows checked against float64."""
    repeat: int
    """Timed runs per method."""
    share: float
    """Seconds a method may take, compiles included, at most."""


GPU = Sizes(16384, 4096, 151936, 64, 5, 60.0)
SMOKE = Sizes(8, 16, 300, 4, 1, 60.0)
DTYPE = torch.bfloat16


class Floor(NamedTuple):
    """The benchmark's GEMMs, each timed alone: the forward's ``[T, H] x [H, V]``, ``d hidden
    = G @ weight`` and ``d weight = G.T @ hidden``, in milliseconds."""

    forward: float
    d_hidden: float
    d_weight: float
    flops: float
    """``2 T H V``: one GEMM's."""

    def four(self) -> float:
        """The forward + backward floor: the logits twice (forward, and recomputed in
        backward), ``d hidden`` and ``d weight``."""
        return 2 * self.forward + self.d_hidden + self.d_weight

    def rate(self) -> float:
        """The measured matmul rate, flop/s: ``8 T H V`` over ``four()``."""
        return 4 * self.flops / (self.four() / 1e3)


def _gemm_ms(device: Device, a: Tensor, b: Tensor, repeat: int) -> float:
    return device.median_ms(lambda: a @ b, repeat)


def gemm_floor(device: Device, x: Tensor, w: Tensor, repeat: int) -> Floor:
    """Time the benchmark's three GEMM shapes (cuBLAS through torch, the default
    settings), on its own data."""
    g = x @ w.t()  # a [T, V] operand of the input dtype, as the logit gradient is
    return Floor(_gemm_ms(device, x, w.t(), repeat), _gemm_ms(device, g, w, repeat), _gemm_ms(device, g.t(), x, repeat),
                 2.0 * x.shape[0] * x.shape[1] * w.shape[0])


def inputs(device: Device, sizes: Sizes) -> tuple[Tensor, Tensor, Tensor]:
    """``hidden``, ``weight`` and targets drawn from each row's softmax (seeded)."""
    gen = torch.Generator(device=device.where).manual_seed(1)
    x = torch.randn(sizes.t, sizes.h, generator=gen, device=device.where).to(DTYPE)
    w = (torch.randn(sizes.v, sizes.h, generator=gen, device=device.where) * (LOGIT_STD / sizes.h**0.5)).to(DTYPE)
    targets = torch.empty(sizes.t, dtype=torch.int64, device=device.where)
    for s in range(0, sizes.t, 1024):
        p = torch.softmax((x[s : s + 1024] @ w.t()).float(), -1)
        targets[s : s + 1024] = torch.multinomial(p, 1, generator=gen)[:, 0]
    return x, w, targets


class Errors(NamedTuple):
    """A method's errors against float64 (None: it computes no such thing)."""

    lp: float | None
    ent: float | None
    d_hidden: float | None
    """Relative to the largest entry of the float64 ``d hidden`` of the checked rows."""
    d_weight: float | None


class Reference:
    """float64 of ``rows`` rows of the benchmark's inputs: their log-probs, entropy and
    logit gradients (of ``sum lp`` and ``sum H`` over those rows), each computed from the
    exact products of the bfloat16 inputs, ``CHUNK`` columns at a time."""

    def __init__(self, x: Tensor, w: Tensor, targets: Tensor, count: int) -> None:
        last = x.shape[0] - 1
        spread = sorted({round(i * last / max(count - 1, 1)) for i in range(count)})
        self.rows = torch.tensor(spread, device=x.device)
        self.w = w
        self.h = x[self.rows].double()
        logits = torch.cat([self.h @ w[s : s + CHUNK].double().t() for s in range(0, w.shape[0], CHUNK)], 1)
        self.largest = float(logits.abs().max())
        logp = torch.log_softmax(logits, -1)
        p = logp.exp()
        ids = targets[self.rows]
        self.lp = logp.gather(1, ids[:, None])[:, 0]
        self.ent = -(p * logp).sum(-1)
        self.g_lp = torch.zeros_like(p).scatter_(1, ids[:, None], 1.0) - p  # d lp / d logits
        self.g_ent = -p * (logp + self.ent[:, None])  # d H / d logits
        self.mask = torch.zeros(x.shape[0], device=x.device)
        self.mask[self.rows] = 1.0

    def value_tolerance(self) -> float:
        """What a log-prob or an entropy of logits rounded to bfloat16 (half an ulp,
        ``2^-9`` of each) may be off by: ``2^-7`` of the largest logit, twice that bound."""
        return 2.0**-7 * self.largest + 1e-4

    def errors(self, method: Method, lp: Tensor | None, ent: Tensor | None, dh: Tensor | None,
               dw: Tensor | None) -> Errors:
        """The method's errors on the checked rows (``dh``, ``dw``: the gradients of its
        check step, whose loss weighs those rows alone)."""
        lp_err = None if lp is None else float((lp.detach()[self.rows].double() - self.lp).abs().max())
        ent_err = None if ent is None else float((ent.detach()[self.rows].double() - self.ent).abs().max())
        if not method.grad or dh is None or dw is None:
            return Errors(lp_err, ent_err, None, None)
        g = self.g_lp + self.g_ent if method.entropy else self.g_lp
        want_h = sum(g[:, s : s + CHUNK] @ self.w[s : s + CHUNK].double() for s in range(0, g.shape[1], CHUNK))
        assert isinstance(want_h, Tensor)
        got_h = method.sign * dh[self.rows].double()
        err_w, top_w = 0.0, 0.0
        for s in range(0, g.shape[1], CHUNK):
            want = g[:, s : s + CHUNK].t() @ self.h
            err_w = max(err_w, float((method.sign * dw[s : s + CHUNK].double() - want).abs().max()))
            top_w = max(top_w, float(want.abs().max()))
        return Errors(lp_err, ent_err, float((got_h - want_h).abs().max()) / float(want_h.abs().max()),
                      err_w / top_w)


class Row(NamedTuple):
    """One method's line of the table."""

    method: Method
    ms: float | None = None
    floor: float | None = None
    """The floor its time is set against (ms): four GEMMs, or one forward only."""
    peak: int | None = None
    """Bytes beyond the inputs and their gradients."""
    errors: Errors | None = None
    kernels: str = ""
    note: str = ""


def launches(seen: _probe.Seen) -> str:
    """The Triton kernels among ``seen``'s launches, each with its count."""
    ran = Counter(e.name for e in seen.of("launch", backend="triton"))
    return ", ".join(f"{name} x{count}" for name, count in sorted(ran.items())) or "none"


def _grad_bytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Step:
    """One method's step on fresh leaves of the inputs: forward, and backward unless it
    runs forward only."""

    def __init__(self, method: Method, x: Tensor, w: Tensor, targets: Tensor) -> None:
        self.method = method
        self.x, self.w = x.detach().requires_grad_(method.grad), w.detach().requires_grad_(method.grad)
        self.targets = targets

    def __call__(self, mask: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
        self.x.grad = self.w.grad = None
        with torch.set_grad_enabled(self.method.grad):
            loss, lp, ent = self.method.run(self.x, self.w, self.targets, mask)
            if loss is not None and self.method.grad:
                loss.backward()  # type: ignore[no-untyped-call]
        return lp, ent


def measure(method: Method, step: _Step, ref: Reference, device: Device, deadline: Deadline, sizes: Sizes,
            floor: float, seconds: float) -> Row:
    """``method``'s row: its check step (watched: compiles, launches, errors), a step
    measured for its peak memory (a warm-up too), then as many of ``sizes.repeat`` timed
    steps as ``seconds`` (its share, compiles included) leave room for (at least one)."""
    began = time.monotonic()
    with deadline.limit(seconds) as allowed:
        with _probe.watch() as seen:
            lp, ent = step(ref.mask)
        device.sync()
        errors = ref.errors(method, lp, ent, step.x.grad, step.w.grad)
        kernels = launches(seen)
        del lp, ent
        step.x.grad = step.w.grad = None
        device.release()
        before = time.monotonic()
        peak = device.peak_growth(step) - (_grad_bytes(step.x, step.w) if method.grad else 0)
        took = time.monotonic() - before
        step.x.grad = step.w.grad = None
        left = allowed - (time.monotonic() - began)
        repeat = max(1, min(sizes.repeat, int(left / max(took, 1e-6)) - 1))
        times = [device.elapsed_ms(step) for _ in range(repeat)]
    ms = sorted(times)[len(times) // 2]
    note = "" if repeat == sizes.repeat else f"{repeat} timed runs (its share of the budget)"
    return Row(method, ms, floor, peak, errors, kernels, note)


def _backend() -> str:
    """The backend the cpslice rows run: ``auto`` (Triton on CUDA), or the Triton
    kernels through the interpreter on the CPU (the smoke run, ``TRITON_INTERPRET=1``)."""
    return "triton" if interpreted() else "auto"


class Bench(NamedTuple):
    """The benchmark's inputs, their GEMMs' floor and their float64 reference."""

    x: Tensor
    w: Tensor
    targets: Tensor
    floor: Floor
    ref: Reference


def setup(device: Device, sizes: Sizes, say: Callable[[str], None]) -> Bench:
    """The inputs, the floor and the reference, each said in a line."""
    x, w, targets = inputs(device, sizes)
    floor = gemm_floor(device, x, w, sizes.repeat)
    device.release()
    say(f"matmul floor (bf16, cuBLAS through torch, this data): forward [T,H]x[H,V] {floor.forward:.2f} ms, "
        f"d hidden {floor.d_hidden:.2f} ms, d weight {floor.d_weight:.2f} ms; four GEMMs (8 T H V) "
        f"{floor.four():.2f} ms at {floor.rate() / 1e12:.3g} TFLOP/s")
    grid = blocks.sizes(device.where.type, DTYPE, sizes.t, sizes.v, blocks.default_hidden_chunk(x, sizes.v), False)
    with selection.using(_backend()):
        say(f"cpslice: CPSLICE_BACKEND {_backend()} runs {backend_for(x, w)} (invariant: "
            f"{backend_for(x, w, invariant=True)}); blocks {grid.rows} rows x {grid.columns} columns "
            f"(CPSLICE_BLOCK_MIB {blocks.block_budget() // 2**20})")
    ref = Reference(x, w, targets, sizes.rows)
    say(f"float64 reference: {ref.rows.numel()} rows, largest logit {ref.largest:.1f}, value tolerance "
        f"{ref.value_tolerance():.1e}")
    say(f"torch materialized holds [T, V] float32 buffers of {sizes.t * sizes.v * 4 / 2**30:.1f} GiB, several at "
        "once (an H100's and an H200's memory hold them)")
    return Bench(x, w, targets, floor, ref)


def rows(bench: Bench, device: Device, sizes: Sizes, deadline: Deadline, stage_end: float) -> Iterator[Row]:
    """Each method's row, in ``methods()``'s order; a method that cannot run here, fails,
    or finds the stage's time (until ``stage_end``, a ``time.monotonic()``) spent is a
    row that says so."""
    for method in methods():
        left = stage_end - time.monotonic()
        if method.missing is not None or (method.needs_cuda and not device.cuda):
            yield Row(method, note=f"skipped: {method.missing or 'needs CUDA'}")
            continue
        if left < 5:
            yield Row(method, note="unmeasured: the stage's time was spent")
            continue
        floor_ms = bench.floor.four() if method.grad else bench.floor.forward
        try:
            with selection.using(_backend()):
                row = measure(method, _Step(method, bench.x, bench.w, bench.targets), bench.ref, device, deadline,
                              sizes, floor_ms, min(sizes.share, left))
        except OverBudget as late:
            row = Row(method, note=f"unmeasured: {late}")
        except Exception as error:  # a peer (or cpslice) that fails is a row that says how
            first = (str(error).splitlines() or [""])[0]
            row = Row(method, note=f"failed: {type(error).__name__}: {first[:160]}")
        device.release()
        yield row


def _size(count: int | None) -> str:
    if count is None:
        return ""
    return f"{count / 2**30:.2f} GiB" if abs(count) >= 2**27 else f"{count / 2**20:.1f} MiB"


def _err(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.1e}"


HEADER = ("| method | ms | x floor | peak beyond inputs + grads | log-prob err | entropy err | d hidden err "
          "| d weight err | cpslice Triton launches (one step) | note |\n|---|---|---|---|---|---|---|---|---|---|")


def line(row: Row) -> str:
    """``row`` as a line of the markdown table under ``HEADER``."""
    e = row.errors or Errors(None, None, None, None)
    ms = "" if row.ms is None else f"{row.ms:.2f}"
    ratio = "" if row.ms is None or row.floor is None else f"{row.ms / row.floor:.2f}x"
    return (f"| {row.method.name} | {ms} | {ratio} | {_size(row.peak)} | {_err(e.lp)} | {_err(e.ent)} | "
            f"{_err(e.d_hidden)} | {_err(e.d_weight)} | {row.kernels} | {row.note} |")
