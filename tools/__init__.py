"""Development tools that are not benchmarks: the wheels a lent GPU machine needs."""
