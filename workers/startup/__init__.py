"""The worker's startup steps: weights, the KV pool's size, kernel warm-up, graph capture and its report."""
