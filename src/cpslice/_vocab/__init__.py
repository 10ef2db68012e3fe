"""The vocabulary engine: per-row softmax statistics over a (tensor-parallel) vocabulary,
from logits computed block by block, with gradients.

One core and three drivers. The core defines the arithmetic of a row once; each driver
computes its blocks of logits its own way and hands them to it:

- ``spec``: the executable spec of docs/invariance.md (invariant mode's ``TILE``,
  ``exp``, ``tanh`` and cap, pairwise ``tree`` sums, ``merge_tiles``, the top-k tie
  rule), which ``invariant`` runs;
- ``softmax``: what the softmax reads of a logit (``Softmax``): the soft cap and the
  temperature, each form written once with its derivative;
- ``shard``: this rank's piece of the vocabulary (``Shard``);
- ``stats``: the per-row statistics (``RowStats``: max, sum of exp, the picked ids'
  logits, the entropy's sum; invariant mode's per tile, ``TileStats``), how blocks and
  TP shards merge (``merge`` of ``Parts``; the shards' after one all-gather,
  ``combine``), the results (``Totals``);
- ``gradient``: the gradient's per-row terms (``RowGrad``, ``row_grad``, ``pick_grad``);
- ``kernels``: the dense kernels over one ``[n, V]`` block, eager or compiled
  (``CPSLICE_BACKEND``, ``backends``; the Triton kernels in ``backends.triton``):
  statistics forward, the gradient backward; invariant mode's in ``invariant`` (with
  ``bits``, a float's bits);
- ``call``: what every driver shares around its blocks: a call's ``Options``, the
  all-gather and each row's result (``finish``), the ``Saved`` record, the backward's
  ``row_terms``;
- ``token_sets``: the ``Support`` record of per-row token sets, its checks and its row
  arithmetic (the public ``cpslice.Support`` subclasses it, adding what needs a layout);
- ``args``: the vocabulary functions' argument checks, and their one entry
  (``options``: every argument but the tensors, checked once into the ``Options``);
  the tensors' checks read a DTensor first (``dtensor``: the local shard of a
  vocabulary-sharded one and its mesh's TP group, the local value of a replicated one);
- drivers: ``logits`` (row chunks of the logits: ``log_probs_and_entropy``; its
  gradient's buffer from ``memory``), ``hidden`` (``[rows, V_block]`` matmul blocks of
  ``hidden @ weight.T``, cut and walked forward by ``blocks``:
  ``log_probs_and_entropy_from_hidden``), and ``set_elements`` (the gathered elements of
  each row's token set, ``Support``), which the other two call for rows with a set;
- ``head``: what the logits come from, the ``Head`` of either driver
  (``logits.LogitsHead``, ``hidden.HiddenHead``), and the one ``torch.autograd.Function``
  of the log-probs and of the top-k over any head, a thin shell over the driver's
  module-level ``forward`` and ``backward``; the public functions and the glue call it.

No module here imports the layout half or the glue (``tests/project/test_imports.py``).
"""
