"""The layout half: where every token of a packed micro-batch sits on one rank.

``layout`` holds the record (``Layout``), ``checks`` its arguments' checks, ``plan`` all
the offset arithmetic of docs/layouts.md; ``pack``, ``extract``, ``redistribute``,
``reduce`` and ``positions`` are the public functions over it. Nothing here imports the
vocabulary engine (``cpslice._vocab``) or the glue (``cpslice._glue``).
"""
