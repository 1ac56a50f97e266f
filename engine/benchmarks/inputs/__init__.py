"""What a benchmark feeds the engine: prompts, arrivals, random checkpoints, model shapes."""
