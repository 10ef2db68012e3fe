"""Train a tiny megatron-core GPTModel with GRPO-style steps, log-probs straight from
its hidden states: no [T, V] logits are ever built.

Two gloo processes, tensor parallel over both (the vocabulary and the layers split in
two), on the CPU: megatron-core's GPTModel (2 layers, hidden 64, vocabulary 128,
float32, local layer spec) with the CPU shims of gpt_cpu.py (next to this file), six
samples packed in one row (block-diagonal causal mask, position ids restarting per
sample). Each step: the model's final hidden states ->
``cpslice.response_log_probs_from_hidden`` (the response rows only) -> clipped-ratio
loss with an entropy bonus (``cpslice.sum_of_sample_means``) -> backward -> SGD. Then
the same steps at TP 1 from the same initial weights, and the difference of the losses.

Printed: the loss of every step, the peak memory of one log-prob step (the LM head,
log-probs, entropy, their backward) on the hidden-state path against the logits path
(megatron's own output layer + ``cpslice.response_log_probs``), and the TP 1 vs TP 2
loss difference.

Run from the repository root (``make demo`` does): ``python examples/train_tiny_gpt.py``
"""

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# This checkout's cpslice, even where another copy is installed (gpt_cpu.py, next to this
# file, is on the path already: Python puts the script's folder first).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # noqa: E402  # public, untyped re-export

from gpt_cpu import rollout, tiny_gpt, train  # noqa: E402

STEPS = 4
LR = 0.2


def lm_head_weight(model: Any) -> Any:
    """Make model(...) return its final hidden states instead of logits; the LM-head
    weight of this TP rank, [V / tp, H] (the embedding's with tied embeddings)."""
    model.output_layer.forward = lambda x, weight=None, runtime_gather_output=None: (x, None)
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def peak_bytes(step: Callable[[], None]) -> int:
    """Peak of the bytes held by CPU tensors while ``step`` runs, beyond those held
    before it: the CPU allocator's running total, as torch's profiler records it."""
    from torch.profiler import ProfilerActivity, profile

    saved = os.dup(2)  # the profiler's own start/stop lines on stderr would clutter the demo
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    events = []

    def walk(nodes: Any) -> None:
        for e in nodes:
            if type(e.extra_fields).__name__ == "_ExtraFields_Allocation":
                events.append((e.start_time_ns, e.extra_fields.total_allocated, e.extra_fields.alloc_size))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    if not events:
        return 0
    events.sort()
    start = events[0][1] - events[0][2]
    return int(max(total for _, total, _ in events) - start)


def measure_memory(model: Any, weight: Any, ro: Any, layout: Any, group: Any) -> tuple[int, ...]:
    """Peak bytes of one log-prob step from the same hidden states: (hidden-state path,
    logits path, one float32 [T, V_local] logits buffer, the hidden and weight gradients)."""
    import cpslice

    ids, pos, mask = ro.model_inputs()
    with torch.no_grad():
        hidden = model(ids, pos, mask)[0]  # [T, H] (the output layer returns its input)
    head = model.output_layer

    def from_hidden() -> None:
        h = hidden.detach().requires_grad_(True)
        lp, ent = cpslice.response_log_probs_from_hidden(
            h, weight, ro.tokens, layout, with_entropy=True, tp_group=group)
        torch.autograd.backward(sum((x.sum() + y.sum() for x, y in zip(lp, ent)), torch.zeros(())))

    def from_logits() -> None:
        h = hidden.detach().requires_grad_(True)
        logits, _ = type(head).forward(head, h[:, None])  # megatron's own output layer: [T, 1, V / tp]
        lp, ent = cpslice.response_log_probs(
            logits[:, 0], ro.tokens, layout, with_entropy=True, tp_group=group)
        torch.autograd.backward(sum((x.sum() + y.sum() for x, y in zip(lp, ent)), torch.zeros(())))

    results = []
    for step in (from_hidden, from_logits):
        step()  # warm up (lazy initialization, caches)
        weight.grad = None
        results.append(peak_bytes(step))
        weight.grad = None
    grads = (hidden.numel() + weight.numel()) * 4
    return results[0], results[1], hidden.shape[0] * weight.shape[0] * 4, grads


def at_tp(tp: int, ro: Any, layout: Any, report: dict[str, Any]) -> None:
    """Build the model with its weights split over ``tp`` ranks, train it, and (at TP 2)
    measure the memory of one log-prob step."""
    from megatron.core import parallel_state as ps

    import cpslice

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    group = ps.get_tensor_model_parallel_group()
    ids, pos, mask = ro.model_inputs()
    model = tiny_gpt(seed=1)
    weight = lm_head_weight(model)

    def policy() -> Any:
        hidden = model(ids, pos, mask)[0]  # [T, H]: one packed row
        return cpslice.response_log_probs_from_hidden(
            hidden, weight, ro.tokens, layout, with_entropy=True, tp_group=group)

    report[f"losses_tp{tp}"] = train(model, policy, ro, layout, steps=STEPS, lr=LR)
    if tp == 2:
        report["memory"] = measure_memory(model, weight, ro, layout, group)
    ps.destroy_model_parallel()


def worker(rank: int, world: int, port: int, out: Any) -> None:
    # the ranks meet at the store main() serves on ``port``
    store = TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core's notes about Transformer Engine and Apex
    import cpslice

    ro = rollout(0)
    layout = cpslice.Layout(ro.total, ro.response)
    report: dict[str, Any] = {}
    for tp in (2, 1):
        at_tp(tp, ro, layout, report)
    out.put((rank, report))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    # served from here on a port the system picks and this process holds until the
    # ranks are done: no other program can take it between choosing and binding
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, store.port, out)) for r in range(2)]
    for p in procs:
        p.start()
    reports = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        print("a rank failed", file=sys.stderr)
        return 1
    r = reports[0]
    print("tiny GPTModel (megatron-core, 2 layers, hidden 64, vocabulary 128, float32), "
          "6 samples packed in one row (63 tokens, 24 response tokens), 2 gloo TP ranks;")
    print("log-probs and entropy from the hidden states (cpslice.response_log_probs_from_hidden), "
          "GRPO-style clipped loss, SGD")
    print(f"{'step':>4}  {'loss (TP 2)':>12}  {'loss (TP 1)':>12}")
    for i, (a, b) in enumerate(zip(r["losses_tp2"], r["losses_tp1"])):
        print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}")
    diff = max(abs(a - b) for a, b in zip(r["losses_tp2"], r["losses_tp1"]))
    hidden_b, logits_b, buffer_b, grads_b = r["memory"]
    print(f"peak memory of one log-prob step (LM head + log-probs + entropy, forward + backward, "
          f"rank 0 of TP 2): hidden-state path {hidden_b / 1024:.1f} KiB, logits path "
          f"{logits_b / 1024:.1f} KiB ({hidden_b / logits_b:.2f}x); both include the hidden and "
          f"weight gradients ({grads_b / 1024:.1f} KiB); one float32 [T, V_local] logits buffer "
          f"is {buffer_b / 1024:.1f} KiB")
    print(f"TP 1 vs TP 2 loss difference: {diff:.2e} (largest over {STEPS} steps)")
    same = all(reports[0][k] == reports[1][k] for k in ("losses_tp2", "losses_tp1"))
    ok = diff <= 1e-5 and same
    print("pass" if ok else "FAIL: the TP 1 and TP 2 losses differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
