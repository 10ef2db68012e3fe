"""The vocabulary tests' fixtures: ``seen``, the instrumentation hook watching the whole
test; ``loose_gemms``, every GEMM setting at its loosest for the test."""

from collections.abc import Iterator

import pytest
import torch

from cpslice import _probe

from ..support.triton_cases import Settings, gemm_settings


@pytest.fixture
def seen() -> Iterator[_probe.Seen]:
    """The library's events of this test (``cpslice._probe.watch``)."""
    with _probe.watch() as events:
        yield events


@pytest.fixture
def loose_gemms() -> Iterator[Settings]:
    """Every GEMM setting at its fastest, loosest value for the test (TF32, reduced
    precision reductions, float16 accumulation, bfloat16 inside oneDNN), as it was after."""
    cuda, onednn = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul  # type: ignore[attr-defined]
    before = (torch.get_float32_matmul_precision(), cuda.fp32_precision, onednn.fp32_precision,
              cuda.allow_bf16_reduced_precision_reduction, cuda.allow_fp16_reduced_precision_reduction,
              cuda.allow_fp16_accumulation)
    try:
        torch.set_float32_matmul_precision("medium")  # TF32 on CUDA, bfloat16 inside oneDNN
        cuda.allow_bf16_reduced_precision_reduction = cuda.allow_fp16_reduced_precision_reduction = True
        cuda.allow_fp16_accumulation = True
        yield gemm_settings()
    finally:
        torch.set_float32_matmul_precision(before[0])
        cuda.fp32_precision, onednn.fp32_precision = before[1:3]
        cuda.allow_bf16_reduced_precision_reduction, cuda.allow_fp16_reduced_precision_reduction = before[3:5]
        cuda.allow_fp16_accumulation = before[5]
