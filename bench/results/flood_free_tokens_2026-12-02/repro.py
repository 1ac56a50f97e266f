"""Replays one replica's flood arrivals into a simulated EngineCore and prints its steps."""
import logging, random, sys, threading, time, tempfile
sys.path.insert(0, '/work/main')
from engine.benchmarks.inputs.model_shapes import write_shape
from tests.utils.tiny_tokenizer import save_tiny_tokenizer
from engine.config import build_engine_config
from engine.core.request import Request
from engine.runtime.engine_core import EngineCore
import os
if os.environ.get("LADDER"): sys.path.insert(0, "/tmp/rep"); import patchladder
if os.environ.get("PATCHCAPS"): sys.path.insert(0, "/tmp/rep"); import patchcaps
from engine.sampling_params import SamplingParams
logging.basicConfig(level=logging.DEBUG, format="%(relativeCreated)7.1f %(name)s %(message)s")
for n in ("engine.runtime.step_log", "monitor.monitor"):
    logging.getLogger(n).setLevel(logging.DEBUG)
d = tempfile.mkdtemp()
tok = save_tiny_tokenizer(d + "/tok")
model = str(write_shape("llama-3.1-8b", d + "/m", tok))
engine = EngineCore(build_engine_config(model, simulate="h100-llama-3.1-8b", max_model_len=40_000))
def req(rid, tokens, slo, max_tokens=64, seed=0):
    rng = random.Random(seed)
    return Request(request_id=rid, prompt_token_ids=[rng.randrange(5, 300) for _ in range(tokens)],
                   sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                   ttft_slo_ms=slo, reports_first_output=True)
# (submit at ms, id, tokens, slo ms, arrived ms before submit)
import json
plan = [tuple(x) for x in json.loads(sys.argv[1])] if len(sys.argv) > 1 else [(0, "r1", 542, 296, 23), (9, "r2", 106, 151, 47), (77, "r3", 348, 231, 93), (79, "r4", 405, 251, 75)]
start = time.monotonic()
def arrive():
    for at, rid, n, slo, before in plan:
        time.sleep(max(0, start + at / 1e3 - time.monotonic()))
        r = req(rid, n, slo, seed=hash(rid) % 100)
        r.arrival_time = time.monotonic() - before / 1e3
        engine.submit_request(r)
t = threading.Thread(target=arrive, daemon=True); t.start()
first = {}
while t.is_alive() or engine.has_unfinished_requests():
    if not engine.has_unfinished_requests():
        time.sleep(0.0005); continue
    for out in engine.step():
        if out.new_token_ids and out.req_id not in first:
            first[out.req_id] = time.monotonic()
            threading.Timer(0.005, engine.note_first_output, (out.req_id, time.monotonic()+0.005)).start()
    if time.monotonic() - start > 1.5: break
for at, rid, n, slo, before in plan:
    print(rid, "ttft %.1f ms of %d" % ((first[rid] - start) * 1e3 - at + before, slo))
engine.shutdown()
