"""Sampling on the worker: the batched sampler, logits processors and logprobs."""
