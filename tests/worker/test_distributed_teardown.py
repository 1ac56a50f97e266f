"""Leaving the process group really ends it: after `destroy`, no gloo thread is left in a rank,
even though the worker read its model's config through transformers after joining the group.

That read imports `torch.distributed.nn` lazily, whose default `group=group.WORLD` arguments are
evaluated at import; imported after init they pinned the default group, its gloo threads lived on
until the interpreter's teardown killed them, and ranks aborted with SIGABRT ("terminate called
without an active exception") after a clean shutdown, failing the TP tests now and then."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from engine.runtime.model_setup import load_hf_config
from tests.utils.tiny_models import make_tiny_model
from workers.distributed import destroy, init_distributed

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                reason="thread names are read from Linux's /proc")


def _gloo_threads() -> list[str]:
    names = [(Path("/proc/self/task") / tid / "comm").read_text().strip()
             for tid in os.listdir("/proc/self/task")]
    return sorted(name for name in names if "gloo" in name)


def _rank(rank: int, model_dir: str, out_dir: str, import_late: bool) -> None:
    groups = init_distributed(rank, 2, f"file://{out_dir}/store", torch.device("cpu"),
                              timeout_s=60)
    if import_late:
        # The probe: re-evaluate torch.distributed.nn's defaults now that a group exists, as a
        # first import after init would.
        importlib.reload(importlib.import_module("torch.distributed.nn.functional"))
    load_hf_config(model_dir)  # what every worker does after joining (transformers' lazy imports)
    during = _gloo_threads()
    destroy(groups)
    del groups  # as a worker process's frames unwind; what is left is held elsewhere
    after = _gloo_threads()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"during": during, "after": after}))
    if import_late:
        os._exit(0)  # the pinned group's threads would die in the teardown: skip it


@pytest.mark.parametrize("import_late", [False, True], ids=["as-workers-join", "probe-late-import"])
def test_destroy_leaves_no_gloo_thread(tmp_path: Path, import_late: bool) -> None:
    model_dir = make_tiny_model(tmp_path / "model", "llama")
    mp.spawn(_rank, args=(model_dir, str(tmp_path), import_late), nprocs=2, join=True)
    for rank in range(2):
        threads = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert threads["during"], "the group ran no gloo thread: nothing was tested"
        if import_late:  # the probe: the pinned default group keeps its threads, and we see them
            assert threads["after"], threads
        else:
            assert threads["after"] == [], threads
