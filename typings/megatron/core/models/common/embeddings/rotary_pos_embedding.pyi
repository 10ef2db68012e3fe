# Stubs for the RoPE method the CPU shims of tests/_gpt.py replace.
from torch import Tensor, nn

class RotaryEmbedding(nn.Module):
    inv_freq: Tensor
    def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> Tensor: ...
    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor: ...
