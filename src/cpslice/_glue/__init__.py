"""The glue: the per-sample functions that read rows and targets from a layout
(``cpslice._layout``) and hand them to the vocabulary engine (``cpslice._vocab``)."""
