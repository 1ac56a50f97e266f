"""CUDA graphs: whole decode batches, and prefill and mixed steps as pieces between the attention ops."""
