"""The public API is exactly what cpslice exports, and every piece of it is documented."""

import inspect

import cpslice

PUBLIC = {
    "Layout", "LayoutError", "ResponseRows", "Strategy", "Support",
    "extract_responses", "extraction_strategy", "shard_responses",
    "pack", "shifted_targets", "response_rows", "position_ids", "attention_mask",
    "log_probs_and_entropy", "response_log_probs", "entropy", "entropy_from_hidden",
    "log_probs_and_entropy_from_hidden", "response_log_probs_from_hidden",
    "redistribute", "gather_responses", "sum_of_sample_means", "sum_of_tokens",
    "clear_caches", "sample_means", "sample_max", "sample_min", "backend_for",
    "log_probs_at", "log_probs_at_from_hidden", "topk_log_probs", "topk_log_probs_from_hidden",
    "topk_divergence", "response_distillation", "response_distillation_from_hidden",
    "response_topk_log_probs", "response_topk_log_probs_from_hidden", "unshard", "vocab_divergence",
    "response_vocab_distillation",
}


def test_all_lists_exactly_the_public_api() -> None:
    assert set(cpslice.__all__) == PUBLIC
    exported = {n for n in dir(cpslice) if not n.startswith("_")}
    if hasattr(cpslice.extract_responses, "__wrapped__"):
        exported.discard("jaxtyping")  # the import hook of the checked test session adds it
    assert exported - PUBLIC == set(), "a name leaks into the public namespace"


def test_every_public_callable_has_a_docstring() -> None:
    for name in PUBLIC - {"Strategy"}:
        obj = getattr(cpslice, name)
        assert inspect.getdoc(obj), name
    for name in ("from_parallel_state", "from_cu_seqlens", "for_rank", "with_local_length", "num_samples",
                 "prompt_lengths"):
        assert inspect.getdoc(getattr(cpslice.Layout, name)), name
    for name in ("from_responses", "from_keep_mask", "num_rows"):
        assert inspect.getdoc(getattr(cpslice.Support, name)), name
