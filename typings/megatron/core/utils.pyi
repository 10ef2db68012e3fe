# Stubs for the parts of megatron.core.utils the CPU shims of tests/_gpt.py replace.
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

class GlobalMemoryBuffer:
    buffer: dict[tuple[str, torch.dtype], Tensor]
    def get_tensor(
        self,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[..., Any] | None = None,
    ) -> Tensor: ...
