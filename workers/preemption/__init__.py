"""Mid-forward SLO preemption on the worker: the vote between layers, suspended passes, the run-ahead limit, and the layer-delay test hook."""
