"""The vocabulary engine's backends: the code that computes the row statistics and the
gradient of a block of logits, and the hidden path's blocks of ``hidden @ weight.T``, one
module per backend, each implementing one interface.

- ``interface``: that interface (``KernelBackend``: ``takes``, the logits path's row
  kernels of both reductions, the hidden path's block kernels), what a backend is asked
  to take (``Task``), and the block kernels' shared default (a torch GEMM, then the row
  kernels), which every backend takes in one line;
- ``selection``: the ordered registry of backend modules, which one computes a task
  (``chain``, ``run``: from the one ``CPSLICE_BACKEND`` names down, the first that takes
  it and computes; ``using`` changes the setting for a block) and all that the backends
  learn at run time;
- ``chunks``: the rows per chunk of the eager and compiled kernels (``Chunks``,
  ``chunks_for``) and the eager loop's work buffers (``Workspace``);
- ``eager``: torch operations, chunk by chunk, of both reductions, and the kernel
  bodies that both the eager and the compiled backend run;
- ``compiled``: everything ``torch.compile``: the compile machinery, the compiled
  kernels of both reductions, and invariant mode's bit check of each compiled result
  against the eager kernels;
- ``triton``: hand-written Triton kernels, Triton imported only when one runs.

The engine calls one interface per reduction, never a backend's module: ``kernels.stats``
and ``kernels.grad`` (the default reduction), ``invariant.stats``,
``invariant.merged_stats``, ``invariant.grad`` and ``invariant.merge_tiles`` (invariant
mode), ``blocks.block_stats`` and ``blocks.block_grad`` (the hidden path's blocks). Each
hands the selection a task and a call of one ``KernelBackend`` member; the selection runs
it on the first backend that takes the task and computes. Nothing falls back silently: a
compile failure in ``auto`` warns once (an error when ``compiled`` is chosen), a compiled
result of invariant mode that differs from the eager bits warns once, ``triton`` chosen
for a tensor it cannot run on is an error, and every kernel launch is an event of the
instrumentation hook (``cpslice._probe``). The backends import the engine's core modules
(``spec``, ``softmax``, ``stats``, ``gradient``, ``rows``, ``memory``) and never a driver;
the selection imports no backend (its registry names their modules, imported when first
reached), and the interfaces import the selection.
"""
