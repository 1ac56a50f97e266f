"""What a benchmark run is checked against: HF greedy output, greedy divergence."""
