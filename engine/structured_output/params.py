"""What a request's output must match (vLLM's `StructuredOutputsParams`, the same field names)."""

from __future__ import annotations

from typing import Any

import msgspec


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Exactly one of `json` (a JSON schema, as a dict or JSON text), `regex`, `choice` (the
    output is one of these strings), `grammar` (EBNF, xgrammar's dialect: GBNF-like) and
    `json_object` (any JSON object). Checked on construction (ValueError); whether the schema,
    regex or grammar itself is well formed is checked by `grammar.grammar_of`."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # vLLM's option: JSON without whitespace beyond what the separators hold (", " and ": ").
    # Default: whitespace allowed between elements, a run of at most
    # grammar.WHITESPACE_RUN_LIMIT characters (a model must not pad its way to max_tokens).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        asked = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        if len(asked) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, "
                             f"grammar and json_object, got {asked or 'none'}")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of "
                             "non-empty strings")

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"
