"""`sloserve bench`: the SLO-attainment benchmark suite, TTFT and TPOT objectives and goodput
(workloads, seeded traces, the policy grid, in-process and HTTP runners, results, the clairvoyant
bound, plots). The standalone measurement scripts sit one level up, in `bench/`."""
