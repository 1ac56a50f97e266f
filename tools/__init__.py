"""Development tools that are not benchmarks: the wheels an air-gapped GPU machine needs."""
