"""megatron-core's GPTModel on the CPU, for train_tiny_gpt.py (next to it) and the tests
(tests/distributed/test_gpt.py imports it from here: pytest puts examples/ on sys.path).

megatron-core 0.16 builds a few tensors on CUDA even with ``use_cpu_initialization``;
four small shims move them to the CPU:

1. ``GlobalMemoryBuffer.get_tensor`` (the tensor-parallel layers' scratch buffer)
   allocates on ``torch.cuda.current_device()``: ours allocates on the CPU;
2. the default causal mask of the local attention is built on CUDA: we always pass
   an explicit boolean mask (``True`` = masked), block-diagonal and causal, so several
   samples packed in one row do not see each other;
3. ``model_parallel_cuda_manual_seed`` seeds CUDA generators: we install a
   tensor-parallel RNG tracker whose ``fork`` swaps the CPU generator's state;
4. RoPE's ``get_emb`` moves ``inv_freq`` to CUDA: ours leaves it where it is.

Packed samples in one row (no Transformer Engine, so no ``thd`` kernels): the
block-diagonal causal mask keeps samples apart and the position ids restart at 0 in
every sample. RoPE scores depend only on relative positions, so a sample placed
anywhere in the row gets the same attention as on its own. Context and sequence
parallelism need Transformer Engine and are not covered.

Everything here is example and test scaffolding, not part of cpslice. The shims are
installed once per process and stay: they replace CUDA-only code paths, which no CPU
process can take, so they change nothing else that process runs on the CPU.
"""

import contextlib
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import torch
from torch import Tensor

_installed = False


class _CpuRNGStatesTracker:
    """The tensor-parallel RNG tracker, on the CPU generator: ``fork(name)`` runs its
    block with that name's generator state and restores the default one after."""

    def __init__(self) -> None:
        self.states: dict[str, Tensor] = {}

    def is_initialized(self) -> bool:
        return bool(self.states)

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> dict[str, Tensor]:
        return dict(self.states)

    def set_states(self, states: dict[str, Tensor]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_get_tensor(
    self: Any, tensor_shape: Sequence[int], dtype: torch.dtype, name: str, mem_alloc_context: Any = None
) -> Tensor:
    need = reduce(operator.mul, tensor_shape, 1)
    buf: Tensor | None = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < need:
        buf = self.buffer[(name, dtype)] = torch.empty(need, dtype=dtype)
    return buf[:need].view(*tensor_shape)


def _cpu_get_emb(self: Any, max_seq_len: int, offset: int = 0) -> Tensor:
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    emb = torch.cat((freqs, freqs), dim=-1)  # not interleaved (the default)
    return emb[:, None, None, :]


def install_cpu_shims(seed: int = 1234) -> None:
    """Install the four CPU shims (idempotent); call after megatron's parallel_state
    is initialized and before building a model."""
    global _installed
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random

    if not _installed:
        utils.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor  # type: ignore[method-assign]
        rotary_pos_embedding.RotaryEmbedding.get_emb = _cpu_get_emb  # type: ignore[method-assign]
        _installed = True
    tracker = _CpuRNGStatesTracker()
    tracker.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    random._CUDA_RNG_STATE_TRACKER = tracker
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}


def tiny_gpt(seed: int = 0, max_len: int = 256, tied: bool = False) -> Any:
    """A 2-layer GPTModel (hidden 64, 4 heads, vocabulary 128, RoPE), float32 on the CPU,
    its weights split over the current TP group. The weights are drawn whole from
    ``seed`` on every rank and then split (``use_cpu_initialization``), so every TP
    size starts from the same model."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    install_cpu_shims(seed)
    config = TransformerConfig(
        num_layers=TINY["num_layers"],
        hidden_size=TINY["hidden_size"],
        num_attention_heads=TINY["num_attention_heads"],
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=_tp_size(),
    )
    torch.manual_seed(seed)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=TINY["vocab_size"],
        max_sequence_length=max_len,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
        parallel_output=True,
    )


def _tp_size() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_tensor_model_parallel_world_size())


def packed_inputs(lengths: Sequence[int]) -> tuple[Tensor, Tensor]:
    """``(position_ids [1, T], attention_mask [1, 1, T, T])`` for samples of ``lengths``
    packed back to back in one row: positions restart at 0 in every sample; the mask
    (``True`` = not attended) is causal within a sample and blocks every other sample."""
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    position = torch.arange(int(sample.numel())) - starts[sample]
    t = int(sample.numel())
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    allowed = causal & (sample[:, None] == sample[None, :])
    return position[None], ~allowed[None, None]


@dataclass
class Rollout:
    """A GRPO-style batch: samples packed in one row, a reward per sample normalized
    over the group into every response token's advantage, loss masks."""

    total: list[int]
    response: list[int]
    tokens: list[Tensor]  # [L_i] int64
    advantages: list[Tensor]  # [R_i]
    masks: list[Tensor]  # [R_i] bool

    def model_inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(input_ids [1, T], position_ids [1, T], attention_mask [1, 1, T, T])``."""
        position_ids, mask = packed_inputs(self.total)
        return torch.cat(self.tokens)[None], position_ids, mask


def rollout(seed: int = 0) -> Rollout:
    """Six samples (an empty response and a one-token one among them), 63 tokens."""
    total, response = [14, 9, 17, 6, 11, 6], [6, 4, 8, 0, 5, 1]
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, TINY["vocab_size"], (t,), generator=gen) for t in total]
    rewards = torch.randn(len(total), generator=gen)
    normalized = (rewards - rewards.mean()) / rewards.std()
    advantages = [torch.full((r,), float(a)) for r, a in zip(response, normalized)]
    masks = [torch.rand(r, generator=gen) > 0.2 for r in response]
    return Rollout(total, response, tokens, advantages, masks)


def ppo_loss(
    log_probs: Sequence[Tensor], entropy: Sequence[Tensor], old: Sequence[Tensor],
    ro: Rollout, layout: Any, clip: float = 0.2, entropy_coef: float = 0.01,
) -> Tensor:
    """Clipped-ratio policy loss with an entropy bonus, each a sum of per-sample means."""
    from cpslice import sum_of_sample_means

    pg = []
    for lp, o, a in zip(log_probs, old, ro.advantages):
        ratio = torch.exp(lp - o)
        pg.append(-torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a))
    return (sum_of_sample_means(pg, ro.masks, layout)
            - entropy_coef * sum_of_sample_means(list(entropy), ro.masks, layout))


def train(
    model: Any, policy: Callable[[], tuple[list[Tensor], list[Tensor]]], ro: Rollout,
    layout: Any, steps: int = 3, lr: float = 0.5,
) -> list[float]:
    """``steps`` SGD steps of ``ppo_loss`` on one batch, the old log-probs taken from the
    model before the first step; the loss of every step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    old: list[Tensor] | None = None
    losses = []
    for _ in range(steps):
        log_probs, entropy = policy()
        if old is None:
            old = [x.detach() for x in log_probs]
        loss = ppo_loss(log_probs, entropy, old, ro, layout)
        opt.zero_grad()
        torch.autograd.backward(loss)
        opt.step()
        losses.append(float(loss))
    return losses
