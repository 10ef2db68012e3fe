"""The vocabulary engine's backends: the code that computes the row statistics and the
gradient of a block of logits, one home per backend.

- ``selection``: which backend computes (``CPSLICE_BACKEND``, read once at import;
  ``using`` changes it for a block) and all that the backends learn at run time;
- ``chunks``: the rows per chunk of the eager and compiled kernels (``Chunks``,
  ``chunks_for``) and the eager loop's work buffers (``Workspace``);
- ``eager``: torch operations, chunk by chunk, of both reductions, and the kernel
  bodies that both the eager and the compiled backend run;
- ``compiled``: everything ``torch.compile``: the compile machinery, the compiled
  kernels of both reductions, and invariant mode's bit check of each compiled result
  against the eager kernels;
- ``triton``: hand-written Triton kernels, imported only when chosen.

The engine calls one interface per reduction, never a backend's module: ``kernels.stats``
and ``kernels.grad`` (the default reduction), ``invariant.stats``,
``invariant.merged_stats``, ``invariant.grad``, ``invariant.merge_tiles`` and
``invariant.set_stats`` (invariant mode). Each asks ``selection.triton_for`` whether the
Triton kernels take the block, else whether the compiled kernels may run
(``compiled.use_compiled``, ``compiled.compiled_ok`` in invariant mode), else runs the
eager ones. Nothing falls back silently: a compile failure in ``auto`` warns once (an
error when ``compiled`` is chosen), a compiled result of invariant mode that differs from
the eager bits warns once, ``triton`` chosen for a tensor it cannot run on is an error,
and every kernel launch is an event of the instrumentation hook (``cpslice._probe``).
The backends import the engine's core modules (``spec``, ``softmax``, ``stats``,
``gradient``, ``rows``, ``memory``); the interface imports the backends, never the other
way round.
"""
