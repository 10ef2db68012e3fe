# The tensor-parallel RNG tracker's module state, which tests/_gpt.py points at the CPU.
from typing import Any

_MODEL_PARALLEL_RNG_TRACKER_NAME: str
_DATA_PARALLEL_RNG_TRACKER_NAME: str
_EXPERT_PARALLEL_RNG_TRACKER_NAME: str
_CUDA_RNG_STATE_TRACKER: Any
_CUDA_RNG_STATE_TRACKER_INITIALIZED: bool
