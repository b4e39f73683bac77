"""Upstream slime's import path for its Megatron helpers that plugins call (`loss.get_log_probs_and_entropy`)."""
