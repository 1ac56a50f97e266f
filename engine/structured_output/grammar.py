"""A request's grammar: built without a tokenizer to check it (the API server refuses a
malformed schema, regex or grammar with a 400 naming what is wrong, before any work), and
compiled for the model's vocabulary in EngineCore (engine.structured_output.compiler).

Both go through the same options, so what the API server accepted is what EngineCore compiles.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import msgspec

from engine.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# The longest run of whitespace allowed between two JSON elements: room for pretty-printed
# output several levels deep, but not for a model that pads with newlines until max_tokens
# (small models do) and never closes the object.
WHITESPACE_RUN_LIMIT = 20

T = TypeVar("T")

# json_object: OpenAI's "a JSON object" (xgrammar's built-in JSON grammar takes any value).
ANY_OBJECT = '{"type": "object"}'

# xgrammar's errors start with a timestamp and its C++ source line: not for a client.
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: (Check failed: .*? is false: )?")


def schema_text(params: StructuredOutputsParams) -> str:
    """The JSON schema as text. Keys keep their order: the grammar asks for an object's
    properties in the order the schema lists them."""
    schema = params.json if params.json is not None else ANY_OBJECT
    return schema if isinstance(schema, str) else json.dumps(schema)


def choice_ebnf(choices: list[str]) -> str:
    """A grammar whose language is exactly `choices` (EBNF string literals take JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def _json_options(params: StructuredOutputsParams) -> dict[str, object]:
    if params.disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": WHITESPACE_RUN_LIMIT}


def _source(params: StructuredOutputsParams) -> tuple[str, str, dict[str, object]]:
    """What the request's grammar is built from: (json_schema | regex | ebnf, the text, the
    options), the same for the tokenizer-free check and the compile."""
    kind = params.kind
    if kind in ("json", "json_object"):
        return "json_schema", schema_text(params), _json_options(params)
    if kind == "regex":
        return "regex", params.regex or "", {}
    if kind == "choice":
        return "ebnf", choice_ebnf(params.choice or []), {}
    return "ebnf", params.grammar or "", {}


def _built(params: StructuredOutputsParams, builders: dict[str, Callable[..., T]]) -> T:
    form, text, options = _source(params)
    try:
        return builders[form](text, **options)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"structured outputs: the {_what(params.kind)} is not valid: "
                         f"{xgrammar_message(exc)}") from None


def grammar_of(params: StructuredOutputsParams) -> xgrammar.Grammar:
    """The request's grammar, tokenizer-free. ValueError naming what is wrong with it."""
    import xgrammar as xgr

    return _built(params, {"json_schema": xgr.Grammar.from_json_schema,
                           "regex": xgr.Grammar.from_regex, "ebnf": xgr.Grammar.from_ebnf})


def compile_for_vocabulary(compiler: xgrammar.GrammarCompiler,
                           params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
    """The request's grammar compiled for the model's vocabulary (xgrammar caches by input).
    ValueError as grammar_of."""
    return _built(params, {"json_schema": compiler.compile_json_schema,
                           "regex": compiler.compile_regex, "ebnf": compiler.compile_grammar})


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error, its first line without the C++ source location."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return _XGRAMMAR_PREFIX.sub("", lines[0]).strip()


def _what(kind: str) -> str:
    return {"json": "JSON schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}.get(kind, kind)


class CheckedGrammars:
    """The grammars the API server has already found well formed, so that an agent's next
    turn with the same tools or schema is not checked again: a check is a hop to another
    thread and back, and every hop lets whatever else the event loop holds (another request's
    parsing) go first. Bounded; the oldest are forgotten first."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._known: dict[bytes, None] = {}

    def known(self, params: StructuredOutputsParams) -> bool:
        return _key(params) in self._known

    def add(self, params: StructuredOutputsParams) -> None:
        key = _key(params)
        self._known.pop(key, None)
        self._known[key] = None
        while len(self._known) > self.capacity:
            del self._known[next(iter(self._known))]


def _key(params: StructuredOutputsParams) -> bytes:
    return msgspec.json.encode(params)
