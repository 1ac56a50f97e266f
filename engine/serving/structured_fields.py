"""The request fields that ask for structured outputs, as OpenAI and vLLM name them, read into
one `StructuredOutputsParams` (engine.structured_output):

- OpenAI's `response_format`: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}, "strict": true}}` (what the openai SDK's
  `chat.completions.parse(response_format=Model)` sends); `{"type": "text"}` asks for nothing;
- vLLM's `structured_outputs`: `{"json": ..., "regex": ..., "choice": [...], "grammar": ...,
  "json_object": true, "disable_any_whitespace": ...}`;
- vLLM's older names: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  `guided_decoding_backend` (only xgrammar here), `guided_whitespace_pattern` (not built).

At most one of them may ask for a constraint: two would leave the output's shape to a rule a
client cannot see. Every error names the field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.serving.request_fields import shown
from engine.structured_output.params import StructuredOutputsParams

# vLLM's structured_outputs keys this server builds (the rest are refused by name below).
_STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object",
                    "disable_any_whitespace", "disable_fallback"}
# vLLM's keys that change the output and are not built here, with the value asking nothing.
_STRUCTURED_NOT_BUILT = {"structural_tag": None, "whitespace_pattern": None,
                         "disable_additional_properties": False}
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
BACKENDS = ("xgrammar", "auto")


def structured_outputs_from(response_format: Any, structured_outputs: dict[str, Any] | None,
                            extras: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's constraint, or None. ValueError naming the field that is wrong.
    ``response_format``: the parsed `ResponseFormat` (or None); ``extras``: the body's
    undeclared fields, where the `guided_*` names arrive."""
    asked: list[tuple[str, StructuredOutputsParams]] = []
    if response_format is not None and response_format.type != "text":
        asked.append(("response_format", _from_response_format(response_format)))
    if structured_outputs is not None:
        asked.append(("structured_outputs", _from_structured_outputs(structured_outputs)))
    guided = {name: extras[name] for name in GUIDED_FIELDS if extras.get(name) is not None}
    backend = extras.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"guided_decoding_backend: only xgrammar is built in (got "
                         f"{shown(backend, 40)})")
    if extras.get("guided_whitespace_pattern") is not None:
        raise ValueError("guided_whitespace_pattern is not supported by this server "
                         "(structured_outputs' disable_any_whitespace is)")
    if guided:
        if len(guided) > 1:
            raise ValueError(f"{' and '.join(guided)}: give one guided_* field")
        (name, value), = guided.items()
        asked.append((name, _params(name, **{name.removeprefix("guided_"): value})))
    if len(asked) > 1:
        raise ValueError(f"{' and '.join(n for n, _ in asked)}: give one way to constrain "
                         f"the output")
    return asked[0][1] if asked else None


def _from_response_format(response_format: Any) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise ValueError("response_format: type json_schema needs json_schema.schema (the "
                         "JSON schema the output must match)")
    return _params("response_format", json=spec.schema_)


def _from_structured_outputs(fields: dict[str, Any]) -> StructuredOutputsParams:
    for key, no_op in _STRUCTURED_NOT_BUILT.items():
        if fields.get(key, no_op) not in (None, no_op):
            raise ValueError(f"structured_outputs.{key} is not supported by this server "
                             f"(got {shown(fields[key], 60)})")
    unknown = sorted(set(fields) - _STRUCTURED_KEYS - set(_STRUCTURED_NOT_BUILT))
    if unknown:
        raise ValueError(f"structured_outputs: unknown key {unknown[0]!r}; it takes "
                         f"{', '.join(sorted(_STRUCTURED_KEYS - {'disable_fallback'}))}")
    given = {k: v for k, v in fields.items()
             if k in _STRUCTURED_KEYS and k != "disable_fallback" and v is not None}
    return _params("structured_outputs", **given)


def _params(field: str, **values: Any) -> StructuredOutputsParams:
    try:
        return msgspec.convert(values, StructuredOutputsParams)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"{field}: {exc}") from None
