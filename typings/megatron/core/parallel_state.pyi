# Stubs for exactly the parts of megatron-core's parallel_state that cpslice
# (and its tests) call. megatron-core ships no type information.
from typing import Callable

from torch.distributed import ProcessGroup

def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Callable[[list[int], int | None], list[int]] | None = None,
    get_position_embedding_ranks: Callable[[list[int], int | None], list[int]] | None = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: list[str] | None = None,
    sharp_enabled_group: str | None = None,
    create_all_gather_group: bool | None = False,
) -> None: ...
def destroy_model_parallel() -> None: ...
def model_parallel_is_initialized() -> bool: ...
def get_context_parallel_rank() -> int: ...
def get_context_parallel_world_size() -> int: ...
def get_context_parallel_group(check_initialized: bool = True) -> ProcessGroup: ...
def get_tensor_model_parallel_rank() -> int: ...
def get_tensor_model_parallel_world_size() -> int: ...
def get_tensor_model_parallel_group(check_initialized: bool = True) -> ProcessGroup: ...
