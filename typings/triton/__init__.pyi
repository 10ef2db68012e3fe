# The part of Triton that cpslice uses (its kernels are checked by running them, under the
# interpreter and on a GPU, not by mypy).
from collections.abc import Callable
from typing import Any

__version__: str

def jit(fn: Callable[..., None]) -> Any: ...
def next_power_of_2(n: int) -> int: ...
def __getattr__(name: str) -> Any: ...
