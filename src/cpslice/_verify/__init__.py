"""``cpslice verify``: every layout end to end on real gloo ranks, against float64.

``runner.run`` spawns ``cp_size * tp_size`` processes on this machine. Each joins one
gloo group, initializes megatron-core's ``parallel_state`` with those sizes and, for
each layout asked for, runs the path of a training step through the public API:

    Layout.from_parallel_state -> pack (its rows of its TP vocabulary shard)
      -> response_log_probs(with_entropy=True, tp_group=<megatron's TP group>)
      -> [allgather and order] redistribute to the zigzag layout
      -> backward of a weighted sum of log-probs and entropy

and compares the log-probs, the entropy and the logits' gradient with a float64
``torch.log_softmax`` of every sample's whole logits, which each process computes
for itself from the seed. The expected shares, loss weights and gradient rows are
read from ``oracle``, a position-by-position transcription of the layout rules that
shares no code with the library's layout arithmetic (``_layout.plan``,
``_layout.pack``, ``_layout.extract``), so a bug there fails a row. Each rank sends its largest errors to
the parent through a queue. Only the children import megatron-core.

Every layout runs two batches: ``samples`` random samples that include the edges
(single-token samples, empty responses, samples shorter than ``2 * cp_size``, whole
responses that cross chunk and rank boundaries), and a few short samples placed so
that some context-parallel ranks hold no response at all (they must still enter every
collective). Each rank's local tensor carries one padding row more than the layout
needs, whose gradient must be zero. Each batch then runs once more with every response
token restricted to a random set of kept ids (``Support.from_responses``, entropy over
the set), its errors folded into the same line.

The default set (``cases.select_cases``, ``--mode all``) holds, besides each mode's
formats and an allgather layout with ``align``, a layout of shared prefixes under the
first mode (``shared_prefix``: groups of samples packed as stars, their prompt once,
which the oracle reads by the rules: a shared prompt row in every branch's share, its
gradient the sum over them), layouts of samples given their own
padded widths through ``Layout.from_cu_seqlens`` (random ``W_i >= L_i``, some several
chunks longer than needed, the last stretched), bshd rows left-padded as Hugging Face
trainers hold them (every prompt padded on the left to the longest, the response after
it, the rows as long as the sample that ends last: ``Layout.from_attention_mask`` of the
batch's mask, checked against ``Layout.from_parallel_state`` with its ``row_offsets``)
and, under context
parallelism, the layout without CP on every CP rank (each holds the whole batch; bshd rows of odd
length, which no rule rounds) and the layouts of token orders (``Layout.from_order``: a
random permutation of the stream and of every bshd row, the stream in shuffled blocks,
and, last, the index of torch's own per-document head-tail load balancer), which the
oracle reads from the order itself. A rank that raises fails the layout it was in, with
its error in the table, and stops the run.

The modules, each importing only those above it:

- ``cases``: which layouts (``Case``, ``select_cases``), sizes, ``Config``;
- ``batches``: the batches (edge cases, sparse samples, an order case's order, built by
  ``cpslice._cli.balancers``) and their float64 reference;
- ``oracle``: the layout rules position by position (imports nothing from cpslice);
- ``check``: one rank's check of a batch (``set_up`` shared by the plain and the
  support check), and the error measure ``max_error``;
- ``rank``: a spawned rank (gloo, parallel_state, every case, a ``Report`` each);
- ``report``: the header, the progress line and the table;
- ``runner``: the parent (store, spawn, start-up and hang timeouts, ``VerifyFailure``,
  ``verify_main``).
"""
