"""Tool calling on the chat route (OpenAI's `tools` and `tool_choice`; docs/design.md section 12):

- `parsers`: the models' own tool-call formats read out of their text (`--tool-call-parser
  hermes | llama3_json | mistral`, picked from the chat template where it is unambiguous);
- `calling`: what a request's `tool_choice` asks (`auto` parses the model's text, `required`
  and a named function constrain it with a JSON schema through structured outputs, `none`
  leaves the text alone) and the `tool_calls` its output holds;
- `partial_json`: the settled part of a call's arguments while they are written (a stream
  sends them in fragments that add up to the whole call's).
"""
