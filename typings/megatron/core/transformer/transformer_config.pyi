# Stubs for the TransformerConfig fields the tests and the example set.
from typing import Any

import torch

class TransformerConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    def __init__(
        self,
        *,
        num_layers: int,
        hidden_size: int,
        num_attention_heads: int,
        use_cpu_initialization: bool = False,
        params_dtype: torch.dtype = ...,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        bias_dropout_fusion: bool = False,
        masked_softmax_fusion: bool = False,
        gradient_accumulation_fusion: bool = False,
        tensor_model_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None: ...
