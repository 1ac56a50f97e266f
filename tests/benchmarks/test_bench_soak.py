"""`sloserve bench soak` (engine/benchmarks/e2e/soak.py): the outcome classification, a few seconds
against a tiny-model server (every outcome seen, nothing lost), and a server whose EngineCore was
killed (the soak must fail)."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from engine.benchmarks.e2e import soak
from engine.benchmarks.e2e.soak_clients import Tally, carries_output, classify_status, classify_stream
from tests.utils.server_helpers import ServerProcess, children, cmdline, wait_gone

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SERVER_ARGS = ["--", "--dtype", "float32", "--num-kv-blocks", "128"]


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("soak-model") / "tiny-chat"
    shutil.copytree(tiny_model("llama"), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(folder)


def outcomes(tally: Tally) -> dict[str, int]:
    return {k: v for k, v in tally.outcomes.items() if v}


def test_stream_outcomes() -> None:
    done = ['data: {"choices": [{"text": "a", "finish_reason": null}]}',
            'data: {"choices": [{"text": "b", "finish_reason": "length"}]}', "data: [DONE]"]
    cases = {
        "completed": done,
        "stream ended without [DONE]": done[:2],
        "stream without a finish_reason": [done[0], done[2]],
        "error event in stream": [done[0], 'data: {"error": {"message": "x", "code": 503}}',
                                  done[2]],
        "event after [DONE]": [*done, done[0]],
    }
    for expected, lines in cases.items():
        tally = Tally()
        classify_stream(tally, "stream_completion", lines, bad=False)
        if expected == "completed":
            assert outcomes(tally) == {"completed": 1}
        else:
            assert outcomes(tally) == {"lost": 1} and dict(tally.lost_reasons) == {expected: 1}
        assert tally.status_5xx == (expected == "error event in stream")
    tally = Tally()
    classify_stream(tally, "bad_input:nan", done, bad=True)
    assert dict(tally.lost_reasons) == {"bad input answered with 200": 1}


def test_ttft_is_taken_at_the_first_output_not_chat_s_role_chunk() -> None:
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    token = {"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]}
    assert not carries_output(f"data: {json.dumps(role)}")
    assert carries_output(f"data: {json.dumps(token)}")
    assert carries_output('data: {"choices": [{"text": "", "finish_reason": "stop"}]}')
    assert carries_output("data: [DONE]")


def test_status_outcomes_and_tracebacks() -> None:
    error = json.dumps({"error": {"message": "temperature must be finite", "code": 400}})
    tally = Tally()
    classify_status(tally, "bad_input:nan", 400, error, bad=True)
    classify_status(tally, "bad_input:nan", 422, '{"detail": "no"}', bad=True)
    classify_status(tally, "completion", 400, error, bad=False)
    classify_status(tally, "bad_input:nan", 500, error, bad=True)
    assert outcomes(tally) == {"rejected_as_expected": 1, "lost": 3}
    assert tally.status_5xx == 1
    tally.saw('{"error": {"message": "Traceback (most recent call last):\\n  File \\"x.py\\""}}')
    tally.saw('{"error": {"message": "bad field"}}')
    assert tally.tracebacks == 1


def test_soak_against_a_tiny_server(model_dir, tmp_path) -> None:
    output = tmp_path / "soak.json"
    code = soak.main(["--model", model_dir, "--clients", "4", "--duration-s", "2",
                      "--max-tokens", "12", "--idle-timeout-s", "10", "--output", str(output),
                      "--server-log", str(tmp_path / "server.log"), *SERVER_ARGS])
    summary = json.loads(output.read_text())
    assert code == 0, (summary["failures"], summary["lost_examples"])
    assert summary["ok"] and summary["lost"] == 0 and summary["status_5xx"] == 0
    assert summary["tracebacks_seen"] == 0 and summary["server_log_tracebacks"] == 0
    # Every kind of outcome happened, so each path of the soak was exercised.
    assert summary["completed"] > 0 and summary["dropped_on_purpose"] > 0
    assert summary["rejected_as_expected"] > 0
    assert summary["requests_sent"] == (summary["completed"] + summary["dropped_on_purpose"]
                                        + summary["rejected_as_expected"])
    assert summary["kv_usage_after"] == 0.0 and summary["after"]["answers_after"]
    assert summary["after"]["num_free_blocks"] == summary["after"]["num_blocks"] == 128
    roles = {p["role"] for p in summary["rss_mib"]["end"]["processes"]}
    assert {"api_server", "engine_core"} <= roles


def test_soak_fails_when_the_engine_is_dead(model_dir, tmp_path) -> None:
    server = ServerProcess(model_dir, tmp_path / "server.log", "--num-kv-blocks", "128")
    try:
        core = [p for p in children(server.pid) if "resource_tracker" not in cmdline(p)]
        assert len(core) == 1, [cmdline(p) for p in core]
        os.kill(core[0], signal.SIGKILL)
        assert not wait_gone(core, 10.0)
        output = tmp_path / "soak.json"
        code = soak.main(["--url", server.url, "--clients", "2", "--duration-s", "1",
                          "--idle-timeout-s", "1", "--output", str(output)])
        summary = json.loads(output.read_text())
        assert code == 1 and not summary["ok"]
        assert summary["lost"] > 0 and summary["status_5xx"] > 0
        assert not summary["after"]["answers_after"]
        assert "engine_core" not in {p["role"] for p in summary["rss_mib"]["end"]["processes"]}
    finally:
        server.kill()
