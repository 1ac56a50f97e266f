"""A chat template that writes OpenAI's harmony format as gpt-oss's does (a system message with
the reasoning effort and the valid channels, the tools as a TypeScript-like `functions`
namespace in a developer message, earlier calls as commentary messages to `functions.NAME`,
tool results from `functions.NAME`, the turn opened with `<|start|>assistant`), written from
the format's description for the tests' tiny checkpoints, which ship no template; and two turns
as gpt-oss writes them."""

from __future__ import annotations

HARMONY_TEMPLATE = (
    "{%- set effort = reasoning_effort | default('medium') -%}"
    "<|start|>system<|message|>You are a helpful assistant.\n"
    "Reasoning: {{ effort }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every "
    "message.{% if tools %}\nCalls to these tools must go to the commentary channel: "
    "'functions'.{% endif %}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\n"
    "namespace functions {\n"
    "{%- for t in tools %}\n\n// {{ t.function.description | default('') }}\n"
    "type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;"
    "{%- endfor %}\n\n} // namespace functions<|end|>{% endif %}"
    "{%- set ns = namespace(last='') %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' or m.role == 'developer' %}"
    "<|start|>developer<|message|># Instructions\n\n{{ m.content }}<|end|>"
    "{%- elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.reasoning_content %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m.reasoning_content }}<|end|>{% endif %}"
    "{%- for c in m.tool_calls or [] %}{% set ns.last = c.function.name %}"
    "<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary "
    "<|constrain|>json<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
    "{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- endif %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ ns.last }} to=assistant"
    "<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")

# What gpt-oss writes after `<|start|>assistant`: thinking, a preamble, a call (its recipient
# after the channel, the content type after <|constrain|>), more thinking after the tool's
# answer would come, and the answer.
TURN = ("<|channel|>analysis<|message|>The user wants the weather in Rome.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Let me look that up.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Rome", "unit": "C"}<|call|>')
ANSWER = ("<|channel|>analysis<|message|>It is sunny.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Sunny, 24 C in Rome.<|return|>")
