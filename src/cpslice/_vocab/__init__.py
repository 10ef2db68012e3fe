"""The vocabulary engine: per-row softmax statistics over a (tensor-parallel) vocabulary,
from logits computed tile by tile, with gradients.

One core and three drivers. The core defines the arithmetic of a row once; each driver
computes its tiles of logits its own way and hands them to it:

- ``stats``: the per-row statistics (``RowStats``: max, sum of exp, the picked ids'
  logits, the entropy's sum), how blocks and TP shards merge (``merge``; the shards'
  after one all-gather, ``combine``), the results (``Totals``), the gradient's per-row
  terms (``RowGrad``), ``FLOOR``;
- ``kernels``: the dense kernels over one ``[n, V]`` tile, eager or compiled
  (``CPSLICE_BACKEND``, ``backend``; the Triton kernels in ``triton``): statistics forward, the gradient backward;
- ``engine``: what every driver shares around its tiles: a call's ``Options``, the
  all-gather and each row's result (``finish``), the ``Saved`` record, the backward's
  ``row_terms``;
- ``support``: the ``Support`` record of per-row token sets, its checks and its row
  arithmetic (the public ``cpslice.Support`` subclasses it, adding what needs a layout);
- ``args``: the vocabulary functions' argument checks, and their one entry
  (``options``: every argument but the tensors, checked once into the ``Options``);
  the tensors' checks read a DTensor first (``dtensor``: the local shard of a
  vocabulary-sharded one and its mesh's TP group, the local value of a replicated one);
- drivers: ``logits`` (row chunks of the logits: ``log_probs_and_entropy``; its
  gradient's buffer from ``memory``), ``hidden`` (``[rows, V_block]`` matmul tiles of
  ``hidden @ weight.T``, cut and walked forward by ``tiles``:
  ``log_probs_and_entropy_from_hidden``), and ``sparse`` (the gathered elements of each
  row's token set, ``Support``), which the other two call for rows with a set;
- ``head``: what the logits come from, the ``Head`` of either driver
  (``logits.LogitsHead``, ``hidden.HiddenHead``), and the one ``torch.autograd.Function``
  of the log-probs and of the top-k over any head, a thin shell over the driver's
  module-level ``forward`` and ``backward``; the public functions and the glue call it.

No module here imports the layout half or the glue (``tests/project/test_imports.py``).
"""
