"""What a model needs beside the packed tokens: each row's position id, and for a model
run without context parallelism the dense attention mask of packed samples and stars.

Both are readings of the layout's ``"sample"`` selection (``plan.py``): the rows that hold
each sample's tokens, each row once (a shared prefix's prompt rows under the group's first
sample).
"""

import torch

from .._errors import LayoutError
from .._types import Targets
from .layout import Layout
from .plan import resolve

_I64 = torch.int64


def position_ids(layout: Layout, device: torch.device | str | None = None) -> Targets:
    """The int64 ``[T]`` position of every local row within its sample: the model's
    position ids beside ``pack(tokens, layout)``.

    A row holding within-sample position ``p`` gets ``p`` (a shared prefix's branch
    continues from its prompt: its first response token is at ``P_j``, whichever
    branch); every other row (a sample's padding, a left-padded row's columns before its
    sample, the tail of the local tensor) gets 0. ``T`` as in ``pack``. On ``device``
    (default the CPU).

    Raises:
        LayoutError: an allgather layout without ``local_length``, as ``pack``.
    """
    local = resolve(layout, spans=("sample",), least=True)
    sel = local.reads["sample"].selection
    out = torch.zeros(local.length, dtype=_I64).index_copy_(0, sel.rows, sel.positions)
    return out.to(device or "cpu")


def attention_mask(layout: Layout, device: torch.device | str | None = None) -> torch.Tensor:
    """The dense bool ``[T, T]`` causal mask of a layout without context parallelism:
    ``mask[q, k]`` is True where query row ``q`` may attend key row ``k``.

    A row attends the rows of its own sample at or before it. With a shared prefix, a
    branch (a sample of a group) attends its group's prompt and its own response rows,
    never another branch's; the prompt attends only itself (causally). A row that holds no
    token (padding) attends only itself, so that no row of a softmax is empty. For small
    models and tests: ``T x T`` booleans (a model with a varlen kernel takes the layout's
    boundaries instead). Pass it as ``mask[None, None]`` where a model takes a 4-D
    boolean mask (True: attend), with ``position_ids(layout)[None]``.

    Raises:
        LayoutError: a layout with context parallelism (a rank's rows attend rows of
            other ranks: build the mask of the whole micro-batch from the layout
            with ``cp_mode="none"``).
    """
    if layout.cp_mode != "none":
        raise LayoutError(
            f"attention_mask is the dense mask of one local tensor without context "
            f"parallelism, but this layout's cp_mode is {layout.cp_mode!r} (its rows attend "
            "rows on other ranks); build it from the same samples with cp_mode='none'"
        )
    local = resolve(layout, spans=("sample",), least=True)
    sel = local.reads["sample"].selection
    t, n = local.length, layout.num_samples
    sample = torch.repeat_interleave(torch.arange(n, dtype=_I64), torch.tensor(sel.counts, dtype=_I64),
                                     output_size=int(sel.rows.numel()))
    groups = layout.shared_prefix or (1,) * n
    star_of = torch.repeat_interleave(torch.arange(len(groups), dtype=_I64), torch.tensor(groups, dtype=_I64),
                                      output_size=n)
    prompt = torch.tensor(layout.prompt_lengths, dtype=_I64)
    shared = layout.shared_prefix is not None
    star = torch.full((t,), -1, dtype=_I64).index_copy_(0, sel.rows, star_of[sample])
    # a shared prompt's rows belong to no branch (-1); every other token row to its sample
    branch_of = torch.where((sel.positions < prompt[sample]) & shared, -1, sample)
    branch = torch.full((t,), -2, dtype=_I64).index_copy_(0, sel.rows, branch_of)
    rows = torch.arange(t, dtype=_I64)
    same = (star[:, None] == star[None, :]) & (star[:, None] >= 0)
    visible = (branch[None, :] == -1) | (branch[:, None] == branch[None, :])
    mask = same & visible & (rows[None, :] <= rows[:, None])
    mask |= torch.eye(t, dtype=torch.bool)
    return mask.to(device or "cpu")
