"""`--chat-template`: a Jinja chat template that replaces the tokenizer's, given as a file path or
inline, as vLLM accepts it. It is read and parsed at startup, so a missing file or a syntax error
fails before any model loads, naming the template."""

from __future__ import annotations

import codecs
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox

# vLLM's rule: a value that cannot be opened as a file but holds one of these is a template.
_JINJA_CHARS = "{}\n"


class _GenerationTag(jinja2.ext.Extension):
    """HF templates may wrap assistant turns in {% generation %} (for assistant-token masks);
    the parse check accepts the tag as transformers' renderer does."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# The extensions transformers renders chat templates with.
_ENV = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])


def load_chat_template(value: str) -> str:
    """The template text: the contents of the file ``value`` names, or else ``value`` itself
    when it looks like a template (single-line form: backslash escapes such as \\n are decoded,
    as vLLM does). Raises ValueError naming the template when it cannot be used."""
    try:
        text = Path(value).read_text()
        source = f"chat template file {value!r}"
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"chat template {value!r}: cannot read it as a file ({exc}), and "
                             f"it is no inline Jinja template either (no '{{', '}}' or "
                             f"newline)") from exc
        text = _decode_escapes(value)
        source = f"inline chat template {_shorten(value)!r}"
    if not text.strip():
        raise ValueError(f"{source} is empty")
    try:
        _ENV.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{source} does not parse as a Jinja template (line {exc.lineno}): "
                         f"{exc.message}") from exc
    return text


def _decode_escapes(value: str) -> str:
    # backslashreplace keeps characters beyond Latin-1 intact through unicode_escape.
    return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")


def _shorten(value: str, limit: int = 60) -> str:
    return value if len(value) <= limit else value[:limit] + "..."
