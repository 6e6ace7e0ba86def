"""The demo model's chat template: ChatML turns and hermes-style tool calls.

It renders the same prompt shape as Qwen2.5/Qwen3 chat models, so that a client (or a
tool-call parser) written for those sees the same text from the demo model:

- turns are `<|im_start|>ROLE\\n...<|im_end|>\\n`;
- `tools` go into the system turn as one JSON object a line inside `<tools></tools>`,
  after the system message if there is one;
- an assistant's `tool_calls` become `<tool_call>\\n{"name": ..., "arguments": ...}\\n
  </tool_call>` blocks after its content;
- consecutive `tool` messages become one user turn of `<tool_response>` blocks.

Only the format is shared with those models; the Jinja below is written here.
"""

from __future__ import annotations

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added as whole tokens but not special: `skip_special_tokens` must keep them in the
# output text, or a tool-call parser could never see them.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_EPILOGUE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

CHAT_TEMPLATE = (
    "{%- set msgs = messages -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if msgs and msgs[0]['role'] == 'system' -%}"
    "{{- msgs[0]['content'] + '\\n\\n' -}}"
    "{%- set msgs = msgs[1:] -%}"
    "{%- endif -%}"
    "{{- " + repr(TOOLS_PREAMBLE) + " -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- " + repr(TOOLS_EPILOGUE) + " + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in msgs -%}"
    "{%- set role = message['role'] -%}"
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{%- if role == 'tool' -%}"
    "{%- if loop.first or msgs[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- if loop.last or msgs[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + role + '\\n' + content -}}"
    "{%- if role == 'assistant' and message.get('tool_calls') -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}"
    "{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if not (loop.last and role == 'assistant' and continue_final_message is defined "
    "and continue_final_message) -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
