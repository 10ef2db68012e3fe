from torch import Tensor

def vocab_parallel_cross_entropy(
    vocab_parallel_logits: Tensor, target: Tensor, label_smoothing: float = 0.0
) -> Tensor: ...
