# Stubs for the GPTModel the tests and examples/train_tiny_gpt.py build.
from typing import Any, Literal

from torch import Tensor, nn

from ...transformer.spec_utils import ModuleSpec
from ...transformer.transformer_config import TransformerConfig

class GPTModel(nn.Module):
    config: TransformerConfig
    output_layer: Any
    share_embeddings_and_output_weights: bool
    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal["learned_absolute", "rope", "mrope", "yarn", "none"] = ...,
        **kwargs: Any,
    ) -> None: ...
    def shared_embedding_or_output_weight(self) -> Tensor: ...
