"""How EngineCore drives the workers: the one package of the engine that imports ``workers``
(tests/project/test_import_layers.py), as vLLM's executors are.

- ``base``: the ``Executor`` protocol EngineCore calls;
- ``factory``: ``make_executor``, which picks one for a configuration, and the
  ``WorkerConfig`` it gives the ranks;
- ``in_process``: TP=1, one worker in EngineCore's own process;
- ``multiproc``: ``--tensor-parallel-size N``, N spawned worker processes on this machine;
- ``external``: ranks torchrun started; rank 0 is the driver in this process;
- ``simulated``: no model; each step takes a step-time profile's time (``--simulate``);
- ``model_support``: what the engine checks against the workers' model code before any
  rank starts.
"""
