"""bench/diagnostics/server_start.py: a server's start timed at the moments a client can see."""

from __future__ import annotations

import json

from bench.diagnostics.server_start import main


def test_one_start_is_timed_in_order(tiny_model, capsys) -> None:
    model = tiny_model("llama")
    capsys.readouterr()
    assert main(["--model", model, "--repeats", "1", "--", "--dtype", "float32",
                 "--max-model-len", "64", "--num-kv-blocks", "16"]) == 0
    report = json.loads(capsys.readouterr().out)
    (run,) = report["runs"]
    # The API server's lifespan starts, then the engine logs its build, then /health answers.
    assert 0 < run["lifespan_s"] < run["engine_built_s"] <= run["healthy_s"]
    assert report["median"] == run
