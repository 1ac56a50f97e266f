"""`sloserve bench run --peer NAME=URL`: the same trace against sloserve and another
OpenAI-compatible server, one after the other, side by side; and the prefix salts that keep one
replay from finding another's prompts in a server's prefix cache."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from engine.benchmarks.attainment.policies import POLICIES
from engine.benchmarks.attainment.salts import PREFIX_SALT_TOKENS, PrefixSalts, salted
from engine.benchmarks.attainment.traces import Trace, TraceRequest

BLOCK = 16  # a prefix cache's block (vLLM's and sloserve's default size)


# ---- a recording stand-in for an OpenAI-compatible server with a prefix cache ---------------

class _Recorder:
    """What the stub server saw: every /v1/completions prompt, and a block-level prefix cache
    (hashes of each prompt's leading full blocks, chained as vLLM's are)."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.cached: set[tuple[int, ...]] = set()
        self.hit_tokens = 0
        self.lock = threading.Lock()

    def admit(self, prompt: list[int]) -> None:
        with self.lock:
            self.prompts.append(prompt)
            full = len(prompt) // BLOCK * BLOCK
            prefixes = [tuple(prompt[:end]) for end in range(BLOCK, full + 1, BLOCK)]
            for prefix in prefixes:  # the longest cached run of leading blocks is a hit
                if prefix not in self.cached:
                    break
                self.hit_tokens += BLOCK
            self.cached.update(prefixes)

    def metrics(self) -> str:
        with self.lock:
            return (f'stub:request_success_total{{finished_reason="length"}} '
                    f"{len(self.prompts)}\nstub:prefix_cache_hits_total {self.hit_tokens}\n")


@contextmanager
def _stub_server() -> Iterator[tuple[str, _Recorder]]:
    recorder = _Recorder()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(recorder.metrics().encode(), "text/plain")
            else:  # /v1/models
                self._send(json.dumps({"data": [{"id": "stub-model"}]}).encode(),
                           "application/json")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["model"] == "stub-model"
            n = body["max_tokens"]
            if not body.get("stream"):
                recorder.admit(body["prompt"])
                self._send(json.dumps({"choices": [{"text": "x" * n}]}).encode(),
                           "application/json")
                return
            chunks = [{"choices": [{"text": "x"}]} for _ in range(n)]
            chunks.append({"choices": [], "usage": {"completion_tokens": n}})
            stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            recorder.admit(body["prompt"])
            self._send(stream.encode(), "text/event-stream")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", recorder
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _trace() -> Trace:
    # Prompts of distinct text, as generate_trace makes them: no two share a first block.
    requests = [TraceRequest(f"{i:05d}-{tier}", tier, 0.01 * i,
                             list(range(100 + 70 * i, 100 + 70 * i + length)), 3,
                             ttft_slo_ms=slo)
                for i, (tier, length, slo) in enumerate([("urgent", 40, 200.0),
                                                         ("document", 64, 2000.0),
                                                         ("urgent", 33, 200.0)])]
    return Trace(requests, meta={"workload": "custom", "rate": 1.0, "seed": 0})


def test_two_replays_of_one_trace_share_no_prompt_prefix():
    """Against one server, two replays of a trace (two budgets, two seeds, or sloserve then a
    peer sharing it) and their warm-ups send prompts that share no first block, each the trace's
    prompt with its first tokens salted; the server's prefix cache finds nothing."""
    from engine.benchmarks.attainment.runners import run_http

    trace = _trace()
    with _stub_server() as (url, recorder):
        runs = [run_http(trace, url, POLICIES["fcfs"], budget, model_name="stub-model",
                         progress=False) for budget in (128, 512)]
    per_replay = 1 + len(trace.requests)  # the warm-up, then the trace
    assert len(recorder.prompts) == 2 * per_replay
    firsts = [tuple(p[:BLOCK]) for p in recorder.prompts]
    assert len(set(firsts)) == len(firsts), "two prompts sent share a first block"
    salts = [tuple(p[:PREFIX_SALT_TOKENS]) for p in recorder.prompts]
    assert len(set(salts)) == len(salts)
    # The same work for every replay: the trace's prompt, its first tokens salt.
    for replay in range(2):
        sent = recorder.prompts[replay * per_replay + 1:(replay + 1) * per_replay]
        expected = sorted(tr.prompt_token_ids[PREFIX_SALT_TOKENS:] for tr in trace.requests)
        assert sorted(p[PREFIX_SALT_TOKENS:] for p in sent) == expected
        assert sorted(map(len, sent)) == sorted(len(tr.prompt_token_ids) for tr in trace.requests)
    assert recorder.hit_tokens == 0
    for run in runs:
        assert run.engine == {"server_finished_requests": len(trace.requests),
                              "server_prefix_cache_hit_tokens": 0}
        assert [r.prompt_tokens for r in run.requests] == [
            len(tr.prompt_token_ids) for tr in trace.requests]
        assert all(r.error is None and r.output_tokens == 3 for r in run.requests)


def test_a_sessions_requests_share_one_salt_and_sessions_do_not():
    """A conversation's turns resend its history: one salt for all of them keeps the shared
    prefix a prefix (the server's cache finds it), and no two conversations share one."""
    from engine.benchmarks.attainment.runners import run_http

    history = list(range(300, 364))
    requests = [TraceRequest("00000-opening", "opening", 0.0, history, 3, ttft_slo_ms=2000.0,
                             session="c0"),
                TraceRequest("00001-opening", "opening", 0.01, list(range(500, 564)), 3,
                             ttft_slo_ms=2000.0, session="c1"),
                TraceRequest("00002-urgent", "urgent", 0.02, [*history, 7, 8, 9], 3,
                             ttft_slo_ms=200.0, session="c0")]
    trace = Trace(requests, meta={"workload": "custom", "rate": 1.0, "seed": 0})
    with _stub_server() as (url, recorder):
        run_http(trace, url, POLICIES["fcfs"], 128, model_name="stub-model", progress=False)
    sent = {tuple(p[PREFIX_SALT_TOKENS:]): tuple(p[:PREFIX_SALT_TOKENS])
            for p in recorder.prompts[1:]}  # after the warm-up
    c0, c1, turn = (sent[tuple(r.prompt_token_ids[PREFIX_SALT_TOKENS:])] for r in requests)
    assert c0 == turn and c0 != c1


def test_salts_come_from_the_prompts_and_never_repeat():
    prompts = [[5, 6, 7], [7, 8]]
    a, b = PrefixSalts(prompts, seed=1), PrefixSalts(prompts, seed=1)  # the same generator
    drawn = [a.draw() for _ in range(50)] + [b.draw() for _ in range(50)]
    assert all(len(s) == PREFIX_SALT_TOKENS and set(s) <= {5, 6, 7, 8} for s in drawn)
    assert len({tuple(s) for s in drawn}) == len(drawn)
    assert PrefixSalts(prompts, 0).draw() == []
    assert salted([1, 2, 3, 4, 5, 6], [9, 9, 9, 9]) == [9, 9, 9, 9, 5, 6]
    assert salted([1, 2], [9, 8, 7, 6]) == [9, 8]  # a prompt shorter than the salt keeps its length


def test_peer_options_are_checked():
    from engine.benchmarks.attainment.peers import Peer, parse_peers

    assert parse_peers(["vllm=http://127.0.0.1:8001/", "sglang=http://h:30000"],
                       ["vllm=smollm"]) == [Peer("vllm", "http://127.0.0.1:8001", "smollm"),
                                            Peer("sglang", "http://h:30000", None)]
    for bad in (["vllm"], ["vllm=127.0.0.1:8001"], ["fcfs=http://x"],
                ["a=http://x", "a=http://y"]):
        with pytest.raises(ValueError):
            parse_peers(bad)
    with pytest.raises(ValueError, match="names no --peer"):
        parse_peers(["vllm=http://x"], ["sglang=m"])


def test_peer_needs_the_http_runner(tmp_path, capsys):
    from engine.entrypoints.cli import main

    assert main(["bench", "run", "--peer", "vllm=http://127.0.0.1:1", "--output-dir",
                 str(tmp_path)]) != 0
    assert "--peer compares servers over HTTP: add --runner http" in capsys.readouterr().err


def test_a_counter_served_under_two_prefixes_counts_once():
    """sloserve serves vLLM's names beside its own (one observation feeds both): a run's probe
    of what reached the server counts one of them."""
    from engine.benchmarks.attainment.runners import server_counter

    page = ('sloserve:request_success_total{model_name="m",finished_reason="length"} 3.0\n'
            'sloserve:request_success_total{model_name="m",finished_reason="stop"} 1.0\n'
            'vllm:request_success_total{model_name="m",engine="0",finished_reason="length"} 3.0\n'
            'vllm:request_success_total{model_name="m",engine="0",finished_reason="stop"} 1.0\n')
    assert server_counter(page, "request_success") == 4
    assert server_counter(page.replace("sloserve:", "x:"), "prefix_cache_hits") is None


def _finished(url: str) -> int:
    from engine.benchmarks.attainment.runners import server_counter

    return server_counter(httpx.get(f"{url}/metrics", timeout=10).text, "request_success") or 0


@pytest.mark.timeout(180)
def test_peer_side_by_side_against_two_servers(tiny_model, tmp_path, capsys):
    """Two sloserve servers with different settings stand in for sloserve and its peer: each
    gets the same trace, one after the other, and the table has a column for each."""
    from engine.benchmarks.attainment.server import serve
    from engine.entrypoints.cli import main
    from monitor.step_time_model import StepTimeModel

    model = tiny_model("llama")
    ttft = tmp_path / "ttft.json"
    StepTimeModel(seconds_per_token=2e-5, intercept_s=0.01).save(ttft)
    common = dict(dtype="float32", max_model_len=512, num_kv_blocks=400,
                  ttft_model=str(ttft))  # prefix caching on: the salts must keep it cold
    out = tmp_path / "out"
    num_requests = 6
    with serve(POLICIES["slo"], 128, model, **common) as ours, \
            serve(POLICIES["fcfs"], 256, model, **common) as peer:
        before = {url: _finished(url) for url in (ours, peer)}
        assert main(["bench", "run", "--model", model, "--dtype", "float32",
                     "--max-model-len", "512", "--ttft-model", str(ttft),
                     "--workload", "burst", "--num-requests", str(num_requests),
                     "--rates", "20", "--seeds", "0", "--budgets", "128",
                     "--runner", "http", "--url", ours, "--policies", "slo",
                     "--peer", f"other={peer}", "--output-dir", str(out)]) == 0
        # Each server counted the run's requests and the warm-up: all reached it.
        for url in (ours, peer):
            assert _finished(url) - before[url] == num_requests + 1
    printed = capsys.readouterr().out
    head = next(line for line in printed.splitlines() if line.startswith("|  |"))
    assert head == "|  | sloserve slo @ 128 | other |"
    for row in ("urgent TTFT attainment (met/total)", "goodput (req/s)",
                "output throughput (tok/s)", "TTFT p50 / p90 / p99 (ms)", "TPOT p50 / p99 (ms)"):
        assert f"| {row} |" in printed
    assert (out / "peers.md").read_text().startswith(printed[printed.index("burst at"):][:40])
    runs = {r["policy"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert set(runs) == {"slo", "other"}
    assert (runs["slo"]["budget"], runs["other"]["budget"]) == (128, 0)
    sent = [[(q["request_id"], q["prompt_tokens"]) for q in run["requests"]]
            for run in runs.values()]
    assert sent[0] == sent[1]  # the same trace, the same work
    for run in runs.values():
        assert run["meta"]["prefix_salt_tokens"] == PREFIX_SALT_TOKENS
        assert all(q["error"] is None and q["output_tokens"] == 16 for q in run["requests"])
        assert run["engine"]["server_finished_requests"] == num_requests
        assert run["engine"]["server_prefix_cache_hit_tokens"] == 0
    assert "| other | own |" in (out / "summary.md").read_text()
