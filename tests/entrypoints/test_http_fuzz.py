"""HTTP fuzzing of the OpenAI routes, generated from the server's own OpenAPI schema.

Hypothesis strategies are built from `/openapi.json` (FastAPI's `app.openapi()`): every request
body follows the schema's shapes, and at every node a hostile value may stand in for the
schema's (NaN, Infinity, ints beyond 64 bits, wrong types, nested junk, huge and odd strings,
lone surrogates, out-of-vocab and negative token ids, empty messages). A few raw bodies that are
not JSON at all, junk headers and the GET routes go along.

Against ONE real server on a tiny model: no 5xx, no traceback text in any body or stream event,
every error in the OpenAI shape, and afterwards the server still serves a normal request, its
engine alive and every KV block free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.utils.server_helpers import ServerProcess, copy_with_chat_template, sse_data

API_KEY = "fuzz-key"
MODEL_NAME = "fuzz-llama"
MAX_MODEL_LEN = 40
BODY_LIMIT = 256 * 1024
ROUTES = ("/v1/completions", "/v1/chat/completions")
GETS = ("/health", "/version", "/metrics", "/debug/stats", "/v1/models", "/openapi.json")
TRACEBACK_MARKERS = ("Traceback", 'File "')

# Hostile values by the JSON type the schema expects there (where a wrong value does the most
# damage: a 2**64 where an integer goes, a NaN where a number goes), and junk of any type.
TYPED_HOSTILE: dict[str, list[Any]] = {
    "integer": [2**63, 2**64, -2**63 - 1, -2**70, 10**40, 10**400, 0, -1, 1.5, 1e300, "7"],
    "number": [math.nan, math.inf, -math.inf, 1e-40, 1e-320, -0.0, 1e308, 2**64, 10**400,
               -1e308, "1.0"],
    "string": ["", "\x00", "\ud800", "\ufeff\u202e", "💥" * 50, "a" * 100_000,
               "a" * (BODY_LIMIT + 1), 7],
    "array": [[], [2**64, -5, 10**9], [-1], [None, 1, "x"], [[[[[]]]]], [""], [{}]],
    "object": [{}, {"a": {"b": [1, {"c": math.nan}]}}, {"role": "user"}],
    "boolean": ["true", 2],
    "null": [0],
}
JUNK: list[Any] = [None, True, "abc", [], {}, [[[[[]]]]], {"a": {"b": [1, {"c": math.nan}]}}]
RAW_BODIES = [b"", b"{", b"null", b"[]", b"42", b'"x"', b"\xff\xfe\x00", b'{"prompt": ',
              b'{"prompt": "Hello", "max_tokens": NaN}', b'{"messages": [{"role": "user", '
              b'"content": "\\ud800"}]}', b'{"prompt": [1, 2, 3], "seed": 1e999}']


# Valid bodies, for the requests that make exactly one field hostile.
BASES = {"/v1/completions": {"prompt": "Hello", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}],
                                  "max_tokens": 2}}


# ---- strategies from the schema -----------------------------------------------------------------

@dataclass
class SchemaStrategies:
    schemas: dict[str, Any]
    vocab_size: int
    strings: list[str] = field(default_factory=list)

    def value(self, schema: dict[str, Any], depth: int = 0,
              faults: bool = True) -> st.SearchStrategy:
        """A value for `schema`; with `faults`, 1 time in 10 a hostile one in its place (at
        any depth). Where the schema has a default, it is drawn half the time, so that many
        bodies get all the way to generation."""
        normal = self._normal(self._resolve(schema), depth, faults)
        if "default" in schema:
            normal = st.one_of(st.just(schema["default"]), normal)
        if not faults:
            return normal
        # Hypothesis starts from, and shrinks towards, small integers: 9 is the odd case.
        return st.integers(0, 9).flatmap(
            lambda r: self.hostile(schema) if r == 9 else normal)

    def hostile(self, schema: dict[str, Any]) -> st.SearchStrategy:
        """A hostile value for where `schema` is expected: mostly of its own type(s)."""
        typed = [v for kind in self._types(schema) for v in TYPED_HOSTILE.get(kind, [])]
        return st.integers(0, 3).flatmap(
            lambda r: st.sampled_from(JUNK if r == 3 or not typed else typed))

    def single_fault(self, schema: dict[str, Any], base: dict[str, Any]) -> st.SearchStrategy:
        """A valid `base` body with exactly one of the schema's top-level fields made hostile:
        the request that reaches deepest (everything else is valid) with the bad value in it."""
        schema = self._resolve(schema)
        names = sorted(schema["properties"])
        return st.tuples(st.sampled_from(names), st.booleans()).flatmap(
            lambda t: self.hostile(schema["properties"][t[0]]).map(
                lambda bad: {**base, "stream": t[1], t[0]: bad}))

    def _resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.schemas[schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def _types(self, schema: dict[str, Any]) -> list[str]:
        schema = self._resolve(schema)
        if "anyOf" in schema:
            return [t for sub in schema["anyOf"] for t in self._types(sub)]
        if "properties" in schema:
            return ["object"]
        return [schema["type"]] if "type" in schema else []

    def _normal(self, schema: dict[str, Any], depth: int, faults: bool) -> st.SearchStrategy:
        if "anyOf" in schema:
            return st.one_of([self.value(s, depth, faults) for s in schema["anyOf"]])
        if "enum" in schema:
            return st.sampled_from(schema["enum"] + (["wizard"] if faults else []))
        kind = schema.get("type")
        if kind == "string":
            return st.one_of(st.sampled_from(self.strings), st.text(max_size=40))
        if kind == "integer":
            # Small counts, and token ids in and out of the vocabulary, negative ones too.
            return st.one_of(st.integers(1, 8), st.integers(-8, self.vocab_size + 8))
        if kind == "number":
            return st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                             st.floats(0, 2), st.integers(-3, 3))
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "array":
            items = schema.get("items", {})
            return st.lists(self.value(items, depth + 1, faults) if depth < 4 else st.none(),
                            min_size=schema.get("minItems", 0), max_size=6 if items else 3)
        if kind == "object" or "properties" in schema:
            return self._object(schema, depth, faults)
        return st.one_of(st.none(), st.integers(), st.text(max_size=10))  # any JSON

    def _object(self, schema: dict[str, Any], depth: int, faults: bool) -> st.SearchStrategy:
        properties = schema.get("properties", {})
        if not properties:  # free-form (chat content parts): text parts, and anything else
            text_part = st.fixed_dictionaries({"type": st.just("text"),
                                               "text": self.value({"type": "string"}, depth + 1,
                                                                  faults)})
            if not faults:
                return text_part
            return st.one_of(text_part, st.fixed_dictionaries(
                {"type": st.sampled_from(["image_url", 7, None]), "text": st.sampled_from(JUNK)}))
        required = [name for name in properties if name in schema.get("required", [])]
        fields = {name: self.value(sub, depth + 1, faults) for name, sub in properties.items()}
        optional = {name: s for name, s in fields.items() if name not in required}
        if faults:
            optional["unknown_field"] = st.sampled_from(JUNK)
        body = st.fixed_dictionaries({name: fields[name] for name in required},
                                     optional=optional)
        if not faults:
            return body
        # One time in ten, the required fields are left out.
        return st.tuples(body, st.integers(0, 9)).map(
            lambda t: {k: v for k, v in t[0].items() if k not in required} if t[1] == 9
            else t[0])


@dataclass
class Call:
    method: str
    path: str
    headers: dict[str, str | bytes]
    content: bytes | None

    def __repr__(self) -> str:  # Hypothesis prints the failing call
        body = None if self.content is None else self.content[:300]
        return f"Call({self.method} {self.path} headers={self.headers} body={body!r})"


def calls(schema: dict[str, Any], vocab_size: int) -> st.SearchStrategy[Call]:
    schemas = schema["components"]["schemas"]
    gen = SchemaStrategies(schemas, vocab_size, strings=[MODEL_NAME, "Hello", "user", "text"])
    auth = st.sampled_from([{"Authorization": f"Bearer {API_KEY}"}] * 6 + [
        {}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer " + "\u00e9" * 3}])
    # httpx writes header values as ASCII: others go out as their UTF-8 bytes.
    auth = auth.map(lambda h: {k: v.encode() for k, v in h.items()})
    slo_header = st.one_of(st.just({}), st.sampled_from(
        ["5", "-1", "nan", "inf", "1e999", "abc", "", "9" * 400]).map(
            lambda v: {"X-SLO-TTFT-MS": v}))
    bodies = []
    for path in ROUTES:
        body_schema = schema["paths"][path]["post"]["requestBody"]["content"][
            "application/json"]["schema"]
        body = st.one_of(gen.single_fault(body_schema, BASES[path]), gen.value(body_schema))
        bodies.append(st.tuples(st.just(path), body.map(_dumps)))
    raw = st.tuples(st.sampled_from(ROUTES), st.sampled_from(RAW_BODIES))
    posts = st.builds(lambda pb, a, h: Call("POST", pb[0], {**a, **h,
                                                            "Content-Type": "application/json"},
                                            pb[1]),
                      st.one_of(*bodies, *bodies, raw), auth, slo_header)
    gets = st.builds(lambda p, a: Call("GET", p, a, None), st.sampled_from(GETS), auth)
    return st.one_of(posts, posts, posts, gets)


def _dumps(body: Any) -> bytes:
    # allow_nan: NaN and Infinity go out as JSON parsers read them; ensure_ascii: a lone
    # surrogate goes out as a \ud800 escape, which the server's parser turns back into one.
    return json.dumps(body, allow_nan=True, ensure_ascii=True).encode()


# ---- checks ---------------------------------------------------------------------------------------

def assert_no_traceback(text: str, call: Call) -> None:
    for marker in TRACEBACK_MARKERS:
        assert marker not in text, f"traceback text in the answer to {call!r}:\n{text[:2000]}"


def assert_openai_error(error: Any, status: int, call: Call) -> None:
    assert isinstance(error, dict), (call, error)
    assert {"message", "type", "param", "code"} <= set(error), (call, error)
    assert isinstance(error["message"], str) and error["message"], (call, error)
    assert error["code"] == status, (call, error)


def check(response: httpx.Response, call: Call) -> None:
    text = response.text
    assert response.status_code < 500, f"{response.status_code} for {call!r}:\n{text[:2000]}"
    assert_no_traceback(text, call)
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, (call, body)
        assert_openai_error(body["error"], response.status_code, call)
        return
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = list(sse_data(text.splitlines()))
        assert events and events[-1] == "[DONE]", (call, text[-500:])
        for event in events[:-1]:
            assert isinstance(event, dict), (call, event)
            if "error" in event:  # what the engine said about this request: not a crash
                assert_openai_error(event["error"], event["error"].get("code"), call)
                assert event["error"]["code"] < 500, (call, event)


# ---- the single-fault sweep ---------------------------------------------------------------------

# Where these go, the answer must be a 400 naming the field.
OUT_OF_RANGE = {"integer": [2**63, 2**64, -2**63 - 1, -2**70, 10**40, 10**400],
                "number": [math.nan, math.inf, -math.inf, 10**400]}


def fault_paths(gen: SchemaStrategies, schema: dict[str, Any], base: Any,
                prefix: tuple = ()) -> list[tuple[tuple, dict[str, Any]]]:
    """(path, schema) of every field the schema declares, nested objects included (into the
    base's first list element where the field is a list of objects)."""
    out = []
    for name, sub in gen._resolve(schema).get("properties", {}).items():
        path = (*prefix, name)
        out.append((path, sub))
        for option in sub.get("anyOf", [sub]):
            option = gen._resolve(option)
            if "properties" in option:
                out += fault_paths(gen, option, None, path)
            elif option.get("type") == "array" and "properties" in gen._resolve(
                    option.get("items", {})) and isinstance(base, dict) and base.get(name):
                out += fault_paths(gen, option["items"], base[name][0], (*path, 0))
    return out


def with_value(base: dict, path: tuple, value: Any) -> dict:
    body = json.loads(json.dumps(base))
    node = body
    for key in path[:-1]:
        node = node[key] if isinstance(key, int) else node.setdefault(key, {})
    node[path[-1]] = value
    return body


def test_every_field_refuses_every_hostile_value(server, schema, model_dir) -> None:
    """Every field the schema declares (nested ones too), on both routes, gets every hostile
    value of its type and the junk values, with the rest of the body valid:
    nothing is a 5xx or shows a traceback; out-of-range numbers are a 400 naming the field."""
    gen = SchemaStrategies(schema["components"]["schemas"], vocab_size=0)
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    swept = refused = 0
    with httpx.Client(base_url=server.url, headers=auth, timeout=60) as client:
        for route, base in BASES.items():
            body_schema = schema["paths"][route]["post"]["requestBody"]["content"][
                "application/json"]["schema"]
            for path, sub in fault_paths(gen, body_schema, base):
                kinds = gen._types(sub)
                values = [v for kind in kinds for v in TYPED_HOSTILE.get(kind, [])] + JUNK
                must_refuse = [v for kind in kinds for v in OUT_OF_RANGE.get(kind, [])]
                for i, value in enumerate(values):
                    # Streamed and not, in turn: both paths see every kind of value.
                    body = with_value({**base, "stream": i % 2 == 1}, path, value)
                    call = Call("POST", route, auth, _dumps(body))
                    response = client.post(route, content=call.content)
                    check(response, call)
                    swept += 1
                    if any(value is v or value == v for v in must_refuse):
                        assert response.status_code == 400, (call, response.text)
                        assert response.json()["error"]["param"] == path[0], response.text
                        refused += 1
    assert swept > 300 and refused > 50, (swept, refused)  # probe: the sweep was not empty


# ---- the test -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory) -> str:
    return copy_with_chat_template(tiny_model("llama", max_position_embeddings=MAX_MODEL_LEN),
                                   tmp_path_factory.mktemp("fuzz-model") / "tiny-chat")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("fuzz-logs") / "server.log",
                        "--served-model-name", MODEL_NAME,
                        "--max-request-body-bytes", str(BODY_LIMIT),
                        "--num-kv-blocks", "64", "--block-size", "16",
                        "--metrics-require-api-key", api_key=API_KEY)
    try:
        yield srv
        srv.assert_clean_stop()  # also: no traceback anywhere in the server's log
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def schema(server) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/openapi.json", timeout=10)
    response.raise_for_status()
    return response.json()


@pytest.mark.timeout(600)
def test_fuzz_openai_routes_from_the_openapi_schema(server, schema, model_dir) -> None:
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(model_dir))
    seen: dict[str, int] = {}

    with httpx.Client(base_url=server.url, timeout=60) as client:
        @settings(max_examples=400, derandomize=True, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate, Phase.shrink],
                  suppress_health_check=list(HealthCheck))
        # Explicit calls, so that the probes below never hang on what a seed happens to draw.
        @example(call=Call("POST", "/v1/completions", {"Content-Type": "application/json"},
                           _dumps({"model": MODEL_NAME, "prompt": "Hello"})))
        @example(call=Call("POST", "/v1/chat/completions",
                           {"Authorization": f"Bearer {API_KEY}".encode(),
                            "Content-Type": "application/json"},
                           _dumps({"model": MODEL_NAME, "messages": "a" * (BODY_LIMIT + 1)})))
        @given(call=calls(schema, vocab_size))
        def fuzz(call: Call) -> None:
            response = client.request(call.method, call.path, headers=call.headers,
                                      content=call.content)
            bucket = f"{call.method} {call.path} {response.status_code}"
            seen[bucket] = seen.get(bucket, 0) + 1
            check(response, call)

        fuzz()

    # Probe: the fuzzer reached generation on both routes, and both refusals and auth errors.
    assert seen.get("POST /v1/completions 200", 0) >= 5, seen
    assert seen.get("POST /v1/chat/completions 200", 0) >= 5, seen
    assert sum(n for k, n in seen.items() if k.endswith(" 400")) >= 50, seen
    assert any(k.endswith(" 401") for k in seen) and any(k.endswith(" 413") for k in seen), seen
    # The server still serves, its engine is alive, and nothing was left in it.
    auth = {"Authorization": f"Bearer {API_KEY}"}
    ok = httpx.post(f"{server.url}/v1/completions", headers=auth, timeout=60,
                    json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    stats, _ = server.wait_all_blocks_free()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["num_running"] == stats["num_waiting"] == 0
