"""The one place cpslice touches megatron-core; imported lazily, only when asked.

Importing megatron-core takes seconds and warns about Transformer Engine and
Apex, so ``import cpslice`` never imports this module.
"""

import torch.distributed as dist

try:
    from megatron.core import parallel_state
except ModuleNotFoundError as err:
    if (err.name or "").split(".")[0] != "megatron":
        raise  # megatron-core is there but one of its own imports failed: say that
    raise ImportError(
        "Layout.from_parallel_state reads megatron-core's parallel_state, and megatron-core "
        "is not installed: pip install 'cpslice[megatron]' (or build the Layout directly "
        "with cp_mode/cp_rank/cp_size)"
    ) from err


def _require_initialized() -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron-core's parallel_state is not initialized: call "
            "torch.distributed.init_process_group(...) and then "
            "parallel_state.initialize_model_parallel(...) first, or build the "
            "Layout directly with cp_mode/cp_rank/cp_size"
        )


def cp_rank_and_size() -> tuple[int, int]:
    """This rank's context-parallel rank and the CP world size."""
    _require_initialized()
    return (
        parallel_state.get_context_parallel_rank(),
        parallel_state.get_context_parallel_world_size(),
    )


def cp_group() -> dist.ProcessGroup:
    """The context-parallel process group."""
    _require_initialized()
    return parallel_state.get_context_parallel_group()


def tp_group() -> dist.ProcessGroup:
    """The tensor-parallel process group (the vocabulary is split over it)."""
    _require_initialized()
    return parallel_state.get_tensor_model_parallel_group()
