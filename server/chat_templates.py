"""Chat templates for the tiny test and demo models (`testing.build_tiny_model(chat_template=)`).

`TOOLS_CHAT_TEMPLATE` is ChatML that renders tools the way Qwen2.5's template does,
i.e. the `hermes` tool-call format, so a tiny model served with `--tool-call-parser
hermes` sees a real tools prompt:

- `tools` -> a system block listing each tool as JSON inside `<tools></tools>`, with
  the instruction to answer calls as `<tool_call>{"name", "arguments"}</tool_call>`
  (after the caller's own system message, when there is one);
- an assistant message's `tool_calls` -> one `<tool_call>` block each, arguments as
  given (OpenAI clients send them as a JSON string; a dict is dumped);
- `role: "tool"` results -> `<tool_response id="<tool_call_id>">…</tool_response>`,
  consecutive ones grouped in one user turn as Qwen2.5 does (the id is an addition
  here, so a test can see which result answers which call);
- `reasoning_content` (or vLLM's newer `reasoning`) on an assistant message ->
  `<think>…</think>` before its content,
  and `enable_thinking=False` (a `chat_template_kwargs` key) closes an empty think
  block in the generation prompt, as Qwen3's template does;
- `continue_final_message` leaves the last message open, like `testing.CHAT_TEMPLATE`.
"""

from __future__ import annotations

TOOLS_CHAT_TEMPLATE = r"""
{%- set first_is_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_is_system -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
        '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif first_is_system -%}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set is_last = loop.last -%}
    {%- set keep_open = is_last and continue_final_message is defined and continue_final_message -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- set thought = message.reasoning_content if message.reasoning_content is defined
                          else (message.reasoning if message.reasoning is defined else none) -%}
        {%- if thought -%}
            {{- '<think>\n' + thought + '\n</think>\n\n' -}}
        {%- endif -%}
        {%- if message.content -%}{{- message.content -}}{%- endif -%}
        {%- if message.tool_calls is defined and message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {%- if message.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
                {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
                {%- if fn.arguments is string -%}{{- fn.arguments -}}
                {%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {%- if not keep_open -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response' -}}
        {%- if message.tool_call_id is defined and message.tool_call_id -%}
            {{- ' id=' + (message.tool_call_id | tojson) -}}
        {%- endif -%}
        {{- '>\n' + message.content + '\n</tool_response>' -}}
        {%- if is_last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + message.content -}}
        {%- if not keep_open -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()
