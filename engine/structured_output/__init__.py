"""Structured outputs: a request's output constrained to a JSON schema, a regex, a choice or a
grammar, with xgrammar doing the work (docs/design.md, section 11).

- `params`: what a request asks for (`SamplingParams.structured_outputs`, vLLM's names);
- `grammar`: the request's grammar without a tokenizer, where a malformed one is refused
  (the API server answers 400), and its compilation for the model's vocabulary;
- `compiler`: EngineCore's compiler, on a thread of its own, cached;
- `matcher`: a request's grammar state, advanced only by committed tokens;
- `bitmask`: the allowed tokens of one step, as the bytes a ScheduledRequest carries.
"""
