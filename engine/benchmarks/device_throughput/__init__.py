"""The device throughput benchmark (`sloserve bench throughput --device ...`): the engine and
HF transformers on one device, a real model shape with dummy weights, against the limits
measured on that device, and what CUDA graphs buy against --enforce-eager.

  benchmark       the run, its options and its result JSON (`python -m bench.suite.gpu_throughput`)
  bounds          the device's limits and each figure's bound; the figures' recorder
  report          the table rows and the markdown
  engine_steps    the engine's side: one engine in this process, each step kind timed
  engine_profile  --profile: torch.profiler over steady-state steps, summarized
  hf_process      HF transformers' side, in a process of its own (`python -m ...hf_process`)
"""
