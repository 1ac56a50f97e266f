"""`sloserve bench flood` (engine/benchmarks/flood/): ten times the queue bound at once against
one simulated server (bound 2, 20 requests). The figures it prints must agree with its raw file
and with the server's own rejection counters, every accepted request must have completed, and
the probe that the flood overflowed the bound: some requests got a 429 naming it. No timing is
asserted: whether urgent requests met their objectives is the benchmark's figure to print."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest

from engine.benchmarks.flood import flood
from engine.benchmarks.flood.client import (DOOMED, OTHER_429, QUEUED_REQS, QUEUED_TOKENS,
                                            reject_reason)
from engine.benchmarks.flood.report import counter_deltas, rejection_counters
from engine.benchmarks.server import launched_server
from tests.utils.server_helpers import CHAT_TEMPLATE

BOUND, REQUESTS = 2, 20


@pytest.fixture(scope="module")
def sim_chat_model(tmp_path_factory) -> str:
    """The Llama-3.1-8B shape for the simulation, with the tiny tokenizer (its own vocabulary,
    so the server describes 400 tokens for structured outputs, not 128k) and a chat template."""
    from transformers import AutoTokenizer

    from engine.benchmarks.inputs.model_shapes import write_shape
    from tests.utils.tiny_tokenizer import save_tiny_tokenizer

    tokenizer = save_tiny_tokenizer(tmp_path_factory.mktemp("flood-tokenizer"))
    folder = write_shape("llama-3.1-8b", tmp_path_factory.mktemp("flood-model"), tokenizer,
                         vocab_size=len(AutoTokenizer.from_pretrained(str(tokenizer))))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(folder)


def _rows(printed: str) -> dict[str, str]:
    """The table's `name  value` rows (a name has no two spaces in a row; the title has none)."""
    rows = {}
    for line in printed.strip().splitlines()[1:]:
        name, _, value = line.partition("  ")
        rows[name] = value.strip()
    return rows


def _counts(samples: str, name: str) -> dict[str, int]:
    return counter_deltas({}, rejection_counters(samples)).get(name, {})


def test_a_flood_of_ten_times_the_bound(sim_chat_model, tmp_path, capsys) -> None:
    serve = ["--model", sim_chat_model, "--simulate", "h100-llama-3.1-8b",
             "--max-model-len", "4096", "--startup-calibration", "off",
             "--max-num-queued-reqs", str(BOUND)]
    out_dir = tmp_path / "flood"
    with launched_server(serve, log_path=tmp_path / "server.log",
                         startup_timeout_s=300.0) as server:
        before = httpx.get(f"{server.url}/metrics").text
        code = flood.main(["--url", server.url, "--model", sim_chat_model,
                           "--queue-bound", str(BOUND), "--num-requests", str(REQUESTS),
                           "--urgent-prompt-tokens", "16", "64",
                           "--relaxed-prompt-tokens", "512", "1024",
                           "--output-dir", str(out_dir)])
        after = httpx.get(f"{server.url}/metrics").text
    printed = capsys.readouterr().out
    assert code == 0, printed
    raw = json.loads((out_dir / "flood.json").read_text())
    records, summary = raw["requests"], raw["summary"]
    assert raw["table"] == printed.strip()
    rows = _rows(printed)

    # The printed figures are the raw records' own.
    status = Counter(r["status"] for r in records)
    reasons = Counter(r["reject_reason"] for r in records if r["status"] == 429)
    accepted = [r for r in records if r["status"] == 200]
    assert len(records) == REQUESTS == int(rows["sent"]) == summary["sent"]
    assert int(rows["200 completed"]) == sum(r["completed"] for r in accepted) == len(accepted)
    assert int(rows["200 incomplete"]) == 0
    assert int(rows["429 queue bound"]) == status[429] == reasons[QUEUED_REQS]
    assert int(rows["429 doomed"]) == int(rows["429 other"]) == 0
    assert int(rows["5xx"]) == int(rows["other"]) == 0
    for kind in ("urgent", "relaxed"):
        mine = [r for r in records if r["kind"] == kind]
        taken = [r for r in mine if r["status"] == 200]
        met = sum(r["ttft_ms"] <= r["ttft_slo_ms"] for r in taken)
        assert rows[f"{kind} accepted"].startswith(
            f"{len(taken)} of {len(mine)}; met objective {met}/{len(taken)}")
    assert rows["result"] == "OK"

    # The client's TTFT beyond the server's own, split at the server's stamps (one host here).
    from engine.benchmarks.flood.client import Record
    from engine.benchmarks.flood.report import outside_server_ms

    splits = [outside_server_ms(Record(**r)) for r in accepted if r["kind"] == "urgent"]
    assert splits and all(s is not None for s in splits)
    for (to_stamp, from_token), r in zip(splits, [r for r in accepted if r["kind"] == "urgent"]):
        assert to_stamp > -5.0 and from_token > -5.0, (to_stamp, from_token)  # (two clocks)
        assert to_stamp + from_token + r["server_ttft_ms"] == pytest.approx(r["ttft_ms"])
    assert rows["urgent outside the server"].startswith("p50 ")
    # Of the way to the server, the client's own writing: every request's body was handed to
    # its connection after its send and before the client read its answer's first byte (both
    # on the client's clock: its trace stamp may come after the server's arrival stamp, which
    # a busy client's loop reaches late, but never after it read a response).
    for r in records:
        assert r["written_ms"] is not None and 0.0 <= r["written_ms"] <= r["e2e_ms"], r
        assert r["ttfb_ms"] is not None and r["written_ms"] <= r["ttfb_ms"], r
    written_p50 = summary["urgent"]["written_p50_ms"]
    assert f"(the client had written it at p50 {written_p50:.0f} ms)" in rows[
        "urgent outside the server"]

    # Every accepted request completed: each choice finished, [DONE] came, no error event.
    for r in accepted:
        assert r["done"] and r["finish_reasons"] == ["length"] and r["error"] is None, r
        assert r["ttft_ms"] is not None and r["output_tokens"] > 0

    # The probe: the flood overflowed the bound, and each refusal says so.
    assert status[429] > 0 and len(accepted) >= BOUND, status
    for r in records:
        if r["status"] == 429:
            assert "--max-num-queued-reqs" in r["error_body"]["error"]["message"]
            assert r["retry_after"] == "1"

    # The server's own counters, read here, count the same 429s the client saw and printed.
    for name in ("vllm:admission_rejections_total", "sloserve:num_requests_rejected_total"):
        moved = {reason: n - _counts(before, name).get(reason, 0)
                 for reason, n in _counts(after, name).items()}
        assert {k: v for k, v in moved.items() if v} == {QUEUED_REQS: status[429]}, name
        assert f"{QUEUED_REQS} {status[429]}," in rows[name] and rows[name].endswith("agree")


def test_a_429_is_told_apart_by_its_body_and_counters_by_their_reason() -> None:
    def body(message: str, **extra) -> dict:
        return {"error": {"message": message, "type": "RateLimitError", "code": 429, **extra}}

    assert reject_reason(body("over its bound of 8 (--max-num-queued-reqs)")) == QUEUED_REQS
    assert reject_reason(body("over its bound (--max-num-queued-tokens)")) == QUEUED_TOKENS
    assert reject_reason(body("no replica can serve it", predicted_ttft_ms=900.0)) == DOOMED
    assert reject_reason(body("slow down")) == reject_reason("not json") == OTHER_429
    text = "\n".join([
        "# TYPE vllm:admission_rejections counter",
        'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"} 3.0',
        'vllm:admission_rejections_total{model_name="m",reason="doomed"} 2.0',
        'vllm:admission_rejections_created{model_name="m",reason="doomed"} 1.7e9',
        # Exported, nothing counted yet (a labelled counter without samples keeps `_total`).
        "# TYPE sloserve:num_requests_rejected_total counter",
        "# TYPE sloserve:fleet_rejected counter",
        'sloserve:fleet_rejected_total{reason="doomed"} 4.0',
        'sloserve:fleet_rejected_total{reason="max_num_queued_reqs"} 1.0'])
    assert rejection_counters(text) == {
        "vllm:admission_rejections_total": {QUEUED_REQS: 3.0, DOOMED: 2.0},
        "sloserve:num_requests_rejected_total": {},
        "sloserve:fleet_rejected_total": {DOOMED: 4.0, QUEUED_REQS: 1.0}}


def test_the_flood_is_registered_as_a_bench_subcommand() -> None:
    from engine.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "flood", "--queue-bound", "3", "--replicas", "3",
                                      "--on-doomed", "reject"])
    assert args.func is flood.run and args.queue_bound == 3 and args.replicas == 3
    assert flood.serve_args(args, "/m")[:6] == [
        "--model", "/m", "--max-num-queued-reqs", "3", "--on-doomed", "reject"]
    assert "--replicas" in flood.serve_args(args, "/m")


def test_the_fleets_reroute_counter_is_read_with_and_without_samples() -> None:
    """The fleet's own /metrics as prometheus_client writes it: a labelled counter with no
    sample yet is exported (read as zero), then counted by reason."""
    pytest.importorskip("ray.serve", reason="the fleet's metrics need Ray Serve: pip install "
                                            "-e '.[test,cluster]'")
    from engine.benchmarks.flood.report import REROUTED_COUNTER
    from engine.fleet.fleet_metrics import FleetMetrics

    metrics = FleetMetrics(lambda: None)
    page = metrics.response().body.decode()
    assert rejection_counters(page, (REROUTED_COUNTER,)) == {REROUTED_COUNTER: {}}
    assert rejection_counters(page)["sloserve:fleet_rejected_total"] == {}
    metrics.rerouted(QUEUED_REQS)
    metrics.rejected(DOOMED)
    page = metrics.response().body.decode()
    assert rejection_counters(page, (REROUTED_COUNTER,)) == {REROUTED_COUNTER: {QUEUED_REQS: 1.0}}
    assert rejection_counters(page)["sloserve:fleet_rejected_total"] == {DOOMED: 1.0}


def test_no_server_to_flood_exits_2_naming_it(capsys) -> None:
    """--url where nothing listens: exit 2 and the address in one line, not a traceback."""
    from engine.ports import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert flood.main(["--url", url]) == 2
    err = capsys.readouterr().err
    assert f"flood: {url}/v1/models: ConnectError" in err and "Traceback" not in err


class _FailingServer:
    """Lists a model (the tiny tokenizer's folder as its root) and answers every POST with a
    500: a server that started and then fails the flood's warm-up."""

    def __init__(self, root: str) -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's spelling)
                if self.path == "/v1/models":
                    self._answer(200, {"data": [{"id": "tiny", "root": root,
                                                 "max_model_len": 4096}]})
                else:
                    self._answer(200, {})

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self._answer(500, {"error": {"message": "the engine is not running"}})

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _FailingServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_server_that_fails_the_warm_up_exits_1_and_a_fault_of_the_tool_is_not_hidden(
        sim_chat_model, capsys, monkeypatch) -> None:
    """A server that fails before the flood: exit 1 with its answer, not "did not start"; and
    an error of the flood's own code (here a RuntimeError raised in the client) is not taken
    for the server's: it reaches the caller with its traceback."""
    with _FailingServer(sim_chat_model) as server:
        assert flood.main(["--url", server.url, "--queue-bound", "1"]) == 1
        err = capsys.readouterr().err
        assert "flood: the warm-up request to /v1/chat/completions failed with HTTP 500" in err
        assert "the engine is not running" in err

        # The probe: past the warm-up, a fault of the tool's own is raised as it is.
        monkeypatch.setattr(flood, "_warm_up", lambda *a: None)
        monkeypatch.setattr(flood, "_metrics", lambda *a: "")

        async def broken_flood(*args):
            raise RuntimeError("a bug in the flood's client")

        monkeypatch.setattr(flood, "flood", broken_flood)
        with pytest.raises(RuntimeError, match="a bug in the flood's client"):
            flood.main(["--url", server.url, "--queue-bound", "1"])


def test_a_server_that_does_not_start_exits_2_with_its_log(capsys) -> None:
    assert flood.main(["--startup-timeout-s", "120", "--", "--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert "flood: sloserve serve exited with" in err and "--no-such-flag" in err
