"""The GEMM settings invariant mode fixes for its own calls (``exact``): a GEMM of one
shape runs one kernel with one reduction order only as long as no setting changes its
arithmetic (TF32, a reduced float32 inside oneDNN, reduced-precision reductions,
float16 accumulation). The hidden path's forward pass and backward walk run inside
``exact_if(invariant)`` (``blocks.dense_pass``, ``hidden.backward``).
"""

import contextlib
from collections.abc import Iterator

import torch

EXACT: tuple[tuple[str, str, object], ...] = (
    ("cuda.matmul", "fp32_precision", "ieee"),
    ("mkldnn.matmul", "fp32_precision", "ieee"),
    ("cuda.matmul", "allow_bf16_reduced_precision_reduction", False),
    ("cuda.matmul", "allow_fp16_reduced_precision_reduction", False),
    ("cuda.matmul", "allow_fp16_accumulation", False),
)
"""The settings under ``torch.backends`` that ``exact`` fixes, each ``(owner, name,
value)``: float32 GEMMs in IEEE float32 (no TF32 on CUDA, no bfloat16 or TF32 inside
oneDNN on the CPU), bfloat16 and float16 GEMMs without reduced-precision reductions
and without float16 accumulation. One this torch does not have is skipped."""


def _owner(path: str) -> object:
    """``torch.backends.<path>`` (None where this torch has none)."""
    owner: object = torch.backends
    for part in path.split("."):
        owner = getattr(owner, part, None)
    return owner


def _read(owner: object, name: str) -> object:
    """A setting's value as its setter takes it back (a reduction's split-K choice too)."""
    value = getattr(owner, name)
    split = getattr(owner, f"{name}_split_k", None) if name.endswith("reduction") else None
    return value if split is None else (value, split)


@contextlib.contextmanager
def exact() -> Iterator[None]:
    """Within the block, GEMMs without the settings that change their bits (``EXACT``, and
    ``torch.set_float32_matmul_precision("highest")``: the legacy ``allow_tf32``), each
    restored after it, the block raising too. A GEMM of one shape then runs one kernel
    with one reduction order. (cuDNN's TF32 setting is a convolution's: no GEMM here
    reads it.)"""
    saved = []
    for path, name, value in EXACT:
        owner = _owner(path)
        try:
            saved.append((owner, name, value, _read(owner, name)))
        except (AttributeError, RuntimeError):  # not in this torch
            continue
    try:  # the process-wide precision, unless the per-backend settings were set apart from it
        legacy: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = None
    try:
        if legacy is not None:
            torch.set_float32_matmul_precision("highest")
        for owner, name, value, before in saved:  # a reduction's split-K choice kept
            setattr(owner, name, (value, before[1]) if isinstance(before, tuple) else value)
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        for owner, name, _, before in saved:
            setattr(owner, name, before)


def exact_if(invariant: bool) -> contextlib.AbstractContextManager[None]:
    """``exact()`` in invariant mode, else nothing."""
    return exact() if invariant else contextlib.nullcontext()
