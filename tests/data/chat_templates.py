"""Chat templates in the style of each family's own, for tests against transformers.

Same tokens, layout and logic as the published ones: system-message handling, role
checks with ``raise_exception``, tools, Qwen3's thinking blocks, Llama 3.1's date and
tool preamble. Not copies of the published files (the models are not in the
repository); what matters is that they exercise the same Jinja features.
"""

# ruff: noqa: E501

LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL = """{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"""

GEMMA = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"""

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

PHI3 = """{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"""

SMOLLM2 = """{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
' }}{% endif %}{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %}"""

QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


HARMONY = """{#- gpt-oss's harmony format: system, developer, channels, tool calls #}
{%- macro ts_type(spec) -%}
    {%- if spec.type == "array" -%}
        {%- if spec['items'] -%}{{- ts_type(spec['items']) + "[]" -}}{%- else -%}{{- "any[]" -}}{%- endif -%}
    {%- elif spec.type is defined and spec.type is iterable and spec.type is not string and spec.type is not mapping -%}
        {{- spec.type | join(" | ") -}}
    {%- elif spec.type == "string" -%}
        {%- if spec.enum -%}{{- '"' + spec.enum | join('" | "') + '"' -}}{%- else -%}{{- "string" -}}{%- endif -%}
    {%- elif spec.type in ["number", "integer"] -%}{{- "number" -}}
    {%- elif spec.type == "boolean" -%}{{- "boolean" -}}
    {%- elif spec.type == "object" and spec.properties -%}
        {{- "{\\n" -}}
        {%- for name, sub in spec.properties.items() -%}
            {{- name -}}{%- if name not in (spec.required or []) -%}{{- "?" -}}{%- endif -%}
            {{- ": " + ts_type(sub) -}}{%- if not loop.last -%}{{- ", " -}}{%- endif -%}
        {%- endfor -%}
        {{- "}" -}}
    {%- else -%}{{- "any" -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro tool_namespace(name, tools) -%}
    {{- "## " + name + "\\n\\nnamespace " + name + " {\\n\\n" }}
    {%- for tool in tools %}
        {%- set tool = tool.function %}
        {{- "// " + (tool.description or "") + "\\ntype " + tool.name + " = " }}
        {%- if tool.parameters and tool.parameters.properties %}
            {{- "(_: {\\n" }}
            {%- for pname, spec in tool.parameters.properties.items() %}
                {{- pname }}{%- if pname not in (tool.parameters.required or []) -%}{{- "?" }}{%- endif -%}
                {{- ": " + ts_type(spec) }}
                {%- if spec.default is defined %}{{- ", // default: " + spec.default | tojson }}{%- endif %}
                {{- ",\\n" }}
            {%- endfor %}
            {{- "}) => any;\\n\\n" }}
        {%- else %}
            {{- "() => any;\\n\\n" }}
        {%- endif %}
    {%- endfor %}
    {{- "} // namespace " + name }}
{%- endmacro -%}
{%- macro system_message() -%}
    {%- if model_identity is not defined %}{%- set model_identity = "You are a helpful model." %}{%- endif %}
    {{- model_identity + "\\nKnowledge cutoff: 2024-06\\nCurrent date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
    {%- if reasoning_effort is not defined %}{%- set reasoning_effort = "medium" %}{%- endif %}
    {{- "Reasoning: " + reasoning_effort + "\\n\\n" }}
    {%- if builtin_tools %}
        {%- set have = namespace(browser=false, python=false) %}
        {%- for t in builtin_tools %}
            {%- if t == "browser" %}{%- set have.browser = true %}{%- elif t == "python" %}{%- set have.python = true %}{%- endif %}
        {%- endfor %}
        {{- "# Tools\\n\\n" }}
        {%- if have.browser %}{{- "## browser\\n\\n" }}{%- endif %}
        {%- if have.python %}{{- "## python\\n\\n" }}{%- endif %}
    {%- endif -%}
    {{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
    {%- if tools -%}{{- "\\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif -%}
{%- endmacro -%}
{{- "<|start|>system<|message|>" + system_message() + "<|end|>" }}
{%- if messages[0].role in ["developer", "system"] %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if developer_message %}{{- "# Instructions\\n\\n" + developer_message + "\\n\\n" }}{%- endif %}
    {%- if tools -%}{{- "# Tools\\n\\n" + tool_namespace("functions", tools) }}{%- endif -%}
    {{- "<|end|>" }}
{%- endif %}
{%- set last_call = namespace(name=none) %}
{%- for message in loop_messages -%}
    {%- if message.role == "assistant" -%}
        {%- if "content" in message and ("<|channel|>analysis<|message|>" in message.content or "<|channel|>final<|message|>" in message.content) %}
            {{- raise_exception("Pass analysis text in the 'thinking' field, not <|channel|> tags in 'content'.") }}
        {%- endif %}
        {%- if "tool_calls" in message %}
            {%- set later = namespace(final=false) %}
            {%- for future in loop_messages[loop.index:] %}
                {%- if future.role == "assistant" and "tool_calls" not in future %}{%- set later.final = true %}{%- endif %}
            {%- endfor %}
            {%- set call = message.tool_calls[0] %}
            {%- if call.function %}{%- set call = call.function %}{%- endif %}
            {%- if message.thinking and not later.final %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" }}
            {{- call.arguments | tojson + "<|call|>" }}
            {%- set last_call.name = call.name %}
        {%- elif loop.last and not add_generation_prompt %}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
        {%- endif %}
    {%- elif message.role == "tool" -%}
        {%- if last_call.name is none %}{{- raise_exception("A tool message must follow a tool call.") }}{%- endif %}
        {{- "<|start|>functions." + last_call.name + " to=assistant<|channel|>commentary<|message|>" + message.content | tojson + "<|end|>" }}
    {%- elif message.role == "user" -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""


FAMILY_TEMPLATES = dict(
    llama31=LLAMA31,
    qwen25=QWEN25,
    qwen3=QWEN3,
    mistral=MISTRAL,
    gemma=GEMMA,
    gemma3=GEMMA3,
    phi3=PHI3,
    smollm2=SMOLLM2,
    harmony=HARMONY,
)

# Training variants in the style of TRL's ``chat_templates/*_training.jinja``: the
# tokens the model produces inside ``{% generation %}`` blocks (what
# ``assistant_only_loss`` trains). ChatML opens the block before the newline after the
# role; Phi-3 closes the conversation with an EOS that later turns replace, so its
# renderings do not extend each other; Gemma keeps its header outside the block.
CHATML_TRAINING = """{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant' }}
        {%- generation %}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n' + call.function | tojson + '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
        {%- endgeneration %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

PHI3_TRAINING = """{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|assistant|>\\n' }}
        {%- generation %}{{- message['content'] + '<|end|>\\n' }}{%- endgeneration %}
    {%- else %}
        {{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}
{%- elif messages[-1]['role'] == 'assistant' %}{% generation %}{{- eos_token }}{% endgeneration %}
{%- else %}{{- eos_token }}{%- endif %}"""

GEMMA_TRAINING = """{{- bos_token -}}
{%- for message in messages -%}
    {%- if message['role'] == 'assistant' -%}
        {{- '<start_of_turn>model\\n' -}}
        {%- generation -%}
            {{- message['content'] | trim + '<end_of_turn>\\n' -}}
        {%- endgeneration -%}
    {%- else -%}
        {{- '<start_of_turn>' + message['role'] + '\\n' + message['content'] | trim + '<end_of_turn>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"""

TRAINING_TEMPLATES = dict(
    chatml=CHATML_TRAINING, phi3=PHI3_TRAINING, gemma=GEMMA_TRAINING
)
