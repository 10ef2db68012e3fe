"""The layout half: where every token of a packed micro-batch sits on one rank.

``layout`` holds the record (``Layout``), ``checks`` its arguments' checks, ``pieces``
and ``plan`` the offset arithmetic of docs/layouts.md (where each rank's rows sit, then
every offset read from that placement); ``pack``, ``extract``, ``redistribute``,
``reduce``, ``positions`` and ``unshard`` are the public functions over it. Nothing here imports the
vocabulary engine (``cpslice._vocab``) or the glue (``cpslice._glue``).
"""
