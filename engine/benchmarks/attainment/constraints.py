"""What a benchmark's urgent requests may carry beside their prompt: a JSON schema
(structured outputs) or a required tool call, so that a burst's attainment can be read for
agents' requests beside plain ones (the grammar must never make a waiter miss).

Each kind constrains every request of the trace's ``urgent`` tier and none of the others.
Its language cannot be finished within any benchmark's output length (a string of at least
4096 characters), so a constrained request decodes exactly the tokens a plain one does: the
runs compare the same work, and what differs is the grammar's compile, its masks and the
scheduling around them.

- ``json``: `response_format` `json_schema` (strict), an object with one long string field.
- ``tool``: the grammar `tool_choice: "required"` constrains a tool call by
  (engine/serving/tool_calls/calling.py), for two tools each taking one long string; sent as
  `structured_outputs` on /v1/completions (tools are a chat field, and the benchmark's prompts
  are token ids).

Each replay's warm-up carries the kind's constraint, so its schema is compiled (and cached) before
the measurement: the runs measure an agent deployment's steady state, where a server has
compiled each of its tools' schemas once. The first compile of a schema is not small: 580-650 ms
for a string with a ``minLength`` (this bench's, whatever the length) against Llama 3's 128k
vocabulary on this CPU, 1-10 ms for typical tool arguments; a server's first request with a new
schema waits for it (measured with the warm-up plain: the first two urgent turns of each seed's
json run missed by 0.5-0.9 s; bench/results/HISTORY.md).
"""

from __future__ import annotations

from typing import Any

from engine.structured_output.params import StructuredOutputsParams

CONSTRAINED_TIER = "urgent"
CONSTRAINTS = ("none", "json", "tool")

# No output of a benchmark's length can finish it: every step is masked.
LONG_STRING_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["summary"],
    "properties": {"summary": {"type": "string", "minLength": 4096}}}

BENCH_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": [argument],
                       "properties": {argument: {"type": "string", "minLength": 4096}}}}}
    for name, argument, description in (("search", "query", "Search the documents"),
                                        ("summarize", "text", "Summarize a passage"))]


def check_constraint(kind: str) -> str:
    if kind not in CONSTRAINTS:
        raise ValueError(f"unknown constraint {kind!r}; choose from {', '.join(CONSTRAINTS)}")
    return kind


def constrains(kind: str, tier: str) -> bool:
    return kind != "none" and tier == CONSTRAINED_TIER


def structured_params(kind: str) -> StructuredOutputsParams | None:
    """The engine's constraint for ``kind`` (None for ``none``), as the API server builds it."""
    if check_constraint(kind) == "none":
        return None
    if kind == "json":
        return StructuredOutputsParams(json=LONG_STRING_SCHEMA)
    from engine.serving.tool_calls.calling import tool_calling

    calling = tool_calling(BENCH_TOOLS, "required", None, None)
    assert calling is not None and calling.constraint is not None
    return calling.constraint


def http_fields(kind: str) -> dict[str, Any]:
    """The request body's fields for ``kind`` on /v1/completions."""
    if check_constraint(kind) == "none":
        return {}
    if kind == "json":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": LONG_STRING_SCHEMA, "strict": True}}}
    params = structured_params(kind)
    assert params is not None
    return {"structured_outputs": {"json": params.json,
                                   "disable_any_whitespace": params.disable_any_whitespace}}


def labelled(policy_name: str, kind: str) -> str:
    """A run's label: the policy's name, and the constraint where there is one."""
    return policy_name if kind == "none" else f"{policy_name} [{kind}]"
