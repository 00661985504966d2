"""Small HF tokenizer directories in the style of Llama 3.1, Llama 4 (pythonic calls), gpt-oss and
Mistral, built offline for the tool-call format tests: a byte-level BPE trained on a few lines, the family's control tokens,
a chat template written here after the family's published prompt format (tools in the system
turn, tool results under Llama's `ipython` header / gpt-oss's `functions.NAME` author; as
Llama 3.1's, one call per assistant message, more refused), and a
generation_config.json whose eos list is the family's (Llama: <|end_of_text|>, <|eom_id|>,
<|eot_id|>; gpt-oss: <|return|>, <|endoftext|>, <|call|>). As gpt-oss's, the harmony-style
template ends the conversation's last answer with <|return|> (what the model generates, so SFT
learns it) and earlier answers with <|end|>; as gpt-oss's, it refuses a tool message that follows
no assistant tool call.
"""
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "What is 2 + 3? Use the calculator tool.",
    '{"name": "calculator", "parameters": {"expression": "2 + 3"}}',
    "The answer is <answer>5</answer>. You are a careful assistant.",
    "Environment: ipython. Given the following functions, respond with a JSON for a function call.",
] * 10

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "{%- if tools %}Environment: ipython\n\n{% endif %}{{ system }}"
    "{%- if tools %}\n\nGiven the following functions, respond with a JSON for a function call with its proper "
    "arguments, in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}."
    "{%- for t in tools %}\n\n{{ t | tojson }}{%- endfor %}{%- endif %}<|eot_id|>"
    "{%- for m in rest %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.tool_calls | length != 1 %}{{ raise_exception('This model only supports single tool-calls at once!') }}"
    "{%- endif %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- set tc = m.tool_calls[0] %}"
    "{\"name\": \"{{ tc.function.name }}\", \"parameters\": {{ tc.function.arguments | tojson }}}<|eot_id|>"
    "{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

LLAMA4_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>",
                   "<|eom|>", "<|python_start|>", "<|python_end|>"]
# Llama 4's pythonic tool prompt: the tools as JSON in the system turn, calls as a Python list of
# keyword calls after the message's content, results under the ipython header as JSON strings.
LLAMA4_PYTHONIC_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- if system or tools %}<|header_start|>system<|header_end|>\n\n{{ system }}"
    "{%- if tools %}\nCall functions in the exact format [func_name1(param1=value1, param2=value2), "
    "func_name2(...)]. The functions:\n{{ tools | tojson }}{%- endif %}<|eot|>{%- endif %}"
    "{%- for m in rest %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|header_start|>assistant<|header_end|>\n\n"
    "{{- m.content or '' }}["
    "{%- for tc in m.tool_calls %}{{ tc.function.name }}("
    "{%- for k, v in tc.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}"
    "{%- endfor %}){% if not loop.last %}, {% endif %}{%- endfor %}]<|eot|>"
    "{%- elif m.role == 'tool' %}<|header_start|>ipython<|header_end|>\n\n{{ m.content | tojson }}<|eot|>"
    "{%- else %}<|header_start|>{{ m.role }}<|header_end|>\n\n{{ m.content | trim }}<|eot|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)

HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                    "<|constrain|>", "<|return|>", "<|call|>"]
HARMONY_STYLE_TEMPLATE = (
    "{%- set last_call = namespace(name=none) %}"
    "<|start|>system<|message|>You are a helpful assistant.\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools %}\nCalls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n"
    "{%- for t in tools %}\n// {{ t.function.description }}\ntype {{ t.function.name }} = "
    "(_: {{ t.function.parameters | tojson }}) => any;{% endfor %}\n} // namespace functions<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.reasoning_content %}<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>"
    "{%- endif %}"
    "{%- if m.tool_calls %}{%- for tc in m.tool_calls %}<|start|>assistant<|channel|>commentary "
    "to=functions.{{ tc.function.name }} <|constrain|>json<|message|>{{ tc.function.arguments | tojson }}<|call|>"
    "{%- set last_call.name = tc.function.name %}{%- endfor %}"
    "{%- elif loop.last and not add_generation_prompt %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|return|>"
    "{%- else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- elif m.role == 'tool' %}{%- if last_call.name is none %}"
    "{{- raise_exception('Message has tool role, but there was no previous assistant message with a tool call!') }}"
    "{%- endif %}<|start|>functions.{{ last_call.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)


MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
MISTRAL_STYLE_TEMPLATE = (
    "{%- set user_turns = messages | selectattr('role', 'equalto', 'user') | list %}"
    # as Mistral's: user and assistant turns alternate, tool results and call turns not counted
    "{%- set ns = namespace(index=0) %}"
    "{%- for m in messages %}"
    "{%- if not (m.role in ('tool', 'system') or (m.tool_calls is defined and m.tool_calls is not none)) %}"
    "{%- if (m.role == 'user') != (ns.index % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- set ns.index = ns.index + 1 %}{%- endif %}{%- endfor %}"
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and m == user_turns[-1] %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    # as Mistral v3's: the system prompt goes into the user message only while it is the last one
    "[INST] {% if loop.last and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] ["
    "{%- for tc in m.tool_calls %}"
    "{%- if tc.id is not defined or tc.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}, "
    "\"id\": \"{{ tc.id }}\"}{%- if not loop.last %}, {% endif %}"
    "{%- endfor %}]{{ eos_token }}"
    "{%- elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}, \"call_id\": \"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{%- endif %}"
    "{%- endfor %}"
)


# IBM Granite 3, written after vLLM's tool_chat_template_granite.jinja: tools as an
# available_tools turn, each call as `<|tool_call|> {"name", "arguments"}`, results as
# tool_response turns; every turn ends with <|end_of_text|> (the eos).
GRANITE_SPECIALS = ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"]
GRANITE_STYLE_TEMPLATE = (
    "{%- if tools %}{{- '<|start_of_role|>available_tools<|end_of_role|>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson(indent=4) }}{%- if not loop.last %}{{- '\\n\\n' }}{%- endif %}"
    "{%- endfor %}{{- '<|end_of_text|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' or m.role == 'user' %}"
    "{{- '<|start_of_role|>' + m.role + '<|end_of_role|>' + m.content + '<|end_of_text|>\\n' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls is defined and m.tool_calls %}"
    "{{- '<|start_of_role|>assistant<|end_of_role|>' }}"
    "{%- for tc in m.tool_calls %}{{- '<|tool_call|> ' + {'name': tc.function.name, "
    "'arguments': tc.function.arguments} | tojson }}{%- endfor %}{{- '<|end_of_text|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|start_of_role|>assistant<|end_of_role|>' + m.content + '<|end_of_text|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|start_of_role|>tool_response<|end_of_role|>' + m.content + '<|end_of_text|>\\n' }}"
    "{%- endif %}"
    "{%- if loop.last and add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
    "{%- endfor %}"
)


# OLMo 3 Instruct (allenai/Olmo-3-*-Instruct), written after the published template: ChatML turns,
# a default system prompt when none is given, the tools as JSON in <functions> of the system
# turn, calls one `name(key=<JSON value>, ...)` a line inside <function_calls>, tool results
# under the `environment` role, and the conversation's last answer closed by eos <|endoftext|>
# (earlier ones by <|im_end|>).
OLMO3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
OLMO3_STYLE_TEMPLATE = (
    "{%- set has_system = messages|selectattr('role', 'equalto', 'system')|list|length > 0 -%}"
    "{%- if not has_system -%}{{- '<|im_start|>system\nYou are OLMo, a helpful AI assistant. ' -}}"
    "{%- if tools is none or (tools | length) == 0 -%}"
    "{{- 'You do not currently have access to any functions. <functions></functions><|im_end|>\n' -}}"
    "{%- else -%}{{- 'You are provided with function signatures within <functions></functions> XML tags. Output any "
    "function calls within <function_calls></function_calls> XML tags.' -}}"
    "{{- '<functions>' -}}{{- tools | tojson -}}{{- '</functions><|im_end|>\n' -}}{%- endif -%}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- '<|im_start|>system\n' + message['content'] -}}"
    "{%- if tools is not none -%}{{- '<functions>' -}}{{- tools | tojson -}}{{- '</functions>' -}}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '<|im_start|>user\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if message.get('content', none) is not none -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if message.get('tool_calls', none) is not none -%}{{- '<function_calls>' -}}"
    "{%- for tool_call in message['tool_calls'] -%}{%- set args = tool_call['function']['arguments'] -%}"
    "{%- set ns = namespace(arguments_list=[]) -%}"
    "{%- for key, value in args.items() -%}"
    "{%- set ns.arguments_list = ns.arguments_list + [key ~ '=' ~ (value | tojson)] -%}"
    "{%- endfor -%}{{- tool_call['function']['name'] + '(' + ns.arguments_list | join(', ') + ')' -}}"
    "{%- if not loop.last -%}{{ '\n' }}{%- endif -%}{%- endfor -%}{{- '</function_calls>' -}}{%- endif -%}"
    "{%- if not loop.last -%}{{- '<|im_end|>' + '\n' -}}{%- else -%}{{- eos_token -}}{%- endif -%}"
    "{%- elif message['role'] == 'tool' -%}{{- '<|im_start|>environment\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- if loop.last and add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
    "{%- endfor -%}"
)


# DeepSeek V3 / R1 (and R1's Qwen / Llama distills), written after the published template as vLLM
# ships it: the system prompt and tools up front, <｜User｜>...<｜Assistant｜> turns, calls as
# `function<｜tool▁sep｜>NAME` and a ```json fence inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>,
# results inside <｜tool▁outputs▁begin｜> ... <｜tool▁outputs▁end｜>, after which the model goes on
# with no generation prompt; every assistant turn ends with <｜end▁of▁sentence｜>.
DEEPSEEK_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                     "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"]
DEEPSEEK_STYLE_TEMPLATE = (
    "{%- set ns = namespace(is_tool=false, is_output_first=true, system_prompt='', is_last_user=false) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'system' -%}"
    "{%- set ns.system_prompt = ns.system_prompt + message['content'] -%}{%- endif -%}{%- endfor -%}"
    "{{- bos_token + ns.system_prompt -}}"
    "{%- if tools -%}{{- '\n\n# Tools\n\n<tools>' -}}{%- for tool in tools -%}{{- '\n' + tool | tojson -}}"
    "{%- endfor -%}{{- '\n</tools>\n\nFor each function call, return <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    "function<｜tool▁sep｜><function_name>\n```json\n<arguments>\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.is_tool = false -%}{%- set ns.is_last_user = true -%}"
    "{{- '<｜User｜>' + message['content'] + '<｜Assistant｜>' -}}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- set ns.is_last_user = false -%}{%- if ns.is_tool -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- endif -%}"
    "{%- set ns.is_tool = false -%}{%- set ns.is_output_first = true -%}"
    "{{- (message['content'] or '') + '<｜tool▁calls▁begin｜>' -}}"
    "{%- for tool in message['tool_calls'] -%}{%- if not loop.first -%}{{- '\n' -}}{%- endif -%}"
    "{{- '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n```json\n' "
    "+ tool['function']['arguments'] | tojson + '\n```<｜tool▁call▁end｜>' -}}{%- endfor -%}"
    "{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' -}}"
    "{%- elif message['role'] == 'assistant' -%}{%- set ns.is_last_user = false -%}"
    "{%- if ns.is_tool -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- set ns.is_tool = false -%}{%- endif -%}"
    "{{- message['content'] + '<｜end▁of▁sentence｜>' -}}"
    "{%- elif message['role'] == 'tool' -%}{%- set ns.is_last_user = false -%}{%- set ns.is_tool = true -%}"
    "{%- if ns.is_output_first -%}{{- '<｜tool▁outputs▁begin｜>' -}}{%- set ns.is_output_first = false -%}"
    "{%- else -%}{{- '\n' -}}{%- endif -%}"
    "{{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if ns.is_tool -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- endif -%}"
    "{%- if add_generation_prompt and not ns.is_last_user and not ns.is_tool -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"
)


# GLM-4.5 (zai-org/GLM-4.5*), written after the published template: [gMASK]<sop>, the tools in a
# system turn, each message opened by its role token and closed by none, so a turn ends with the
# token that opens the next: <|observation|> (the tool results, each in <tool_response>) or
# <|user|>; past answers carry an empty <think></think>; calls are `<tool_call>NAME` with
# <arg_key>/<arg_value> pairs, string values raw and the rest as JSON.
GLM45_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
GLM45_STYLE_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if tools -%}<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "<tools>\n{%- for tool in tools %}{{ tool | tojson }}\n{% endfor -%}</tools>\n\nFor each function call, output "
    "the function name and arguments within the following XML format:\n<tool_call>{function-name}\n"
    "<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>\n{{ m.content }}"
    "{%- elif m.role == 'user' -%}<|user|>\n{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>\n<think></think>"
    "{%- if m.content and m.content.strip() -%}{{ '\n' + m.content.strip() }}{%- endif -%}"
    "{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}{{ '\n<tool_call>' + tc.function.name }}"
    "{%- for k, v in tc.function.arguments.items() -%}{{ '\n<arg_key>' + k + '</arg_key>\n<arg_value>' }}"
    "{{- v if v is string else v | tojson }}{{ '</arg_value>' }}{%- endfor -%}{{ '\n</tool_call>' }}"
    "{%- endfor -%}{%- endif -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}"
    "{{ '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


# Gemma 3 (google/gemma-3-*-it), written after the published template: no system role (its text
# opens the first user turn), strict user/model alternation, contents trimmed, each turn closed
# by <end_of_turn> and a newline; no tools.
GEMMA3_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
GEMMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


# SmolLM3's layout (written after its published template): ChatML turns; the tools come in the
# `xml_tools` variable, not HF's `tools`, each printed as a Python dict; an assistant message is
# its content alone (tool_calls are never read); tool results are user turns.
SMOLLM3_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
SMOLLM3_STYLE_TEMPLATE = (
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are SmolLM.' }}{%- endif %}"
    "{%- if xml_tools %}{{- '\\n### Tools\\n<tools>\\n' }}{%- for tool in xml_tools %}{{- tool | string }}{{- '\\n' }}"
    "{%- endfor %}{{- '</tools>\\nReturn each call as <tool_call>\\n'"
    "'{\"name\": ..., \"arguments\": ...}\\n</tool_call>' }}"
    "{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- for m in messages %}{%- set content = m.content if m.content is string else '' %}"
    "{%- if m.role == 'user' or m.role == 'tool' %}{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# Kimi K2 (Instruct / Thinking), written after the published prompt format: the tools declared
# first as a JSON list in a `tool_declare` system turn, a default system prompt when the
# conversation has none, every message <|im_ROLE|>NAME<|im_middle|>...<|im_end|>; an assistant
# turn opens with its thinking (empty up to the last plain answer, the message's
# reasoning_content after it), then its content and a <|tool_calls_section_begin|> section whose
# calls carry their ids (`functions.NAME:INDEX`); a tool result is headed "## Return of ID".
KIMI_K2_SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                    "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"]
KIMI_K2_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_answer=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' and not m.get('tool_calls') -%}"
    "{%- set ns.last_answer = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- if not messages or messages[0].role != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant.<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|im_user|>{{ m.get('name') or 'user' }}<|im_middle|>"
    "{%- elif m.role == 'assistant' -%}<|im_assistant|>{{ m.get('name') or 'assistant' }}<|im_middle|>"
    "{%- else -%}<|im_system|>{{ m.get('name') or m.role }}<|im_middle|>{%- endif -%}"
    "{%- if m.role == 'assistant' -%}"
    "<think>{{ m.get('reasoning_content') or '' if loop.index0 > ns.last_answer else '' }}</think>"
    "{{- m.content or '' -}}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for tc in m.tool_calls -%}<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>"
    "{%- if tc.function.arguments is string -%}{{ tc.function.arguments }}"
    "{%- else -%}{{ tc.function.arguments | tojson }}{%- endif -%}<|tool_call_end|>{%- endfor -%}"
    "<|tool_calls_section_end|>{%- endif -%}"
    "{%- elif m.role == 'tool' -%}## Return of {{ m.tool_call_id }}\n{{ m.content }}"
    "{%- else -%}{{ m.content }}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

# MiniMax-M2, written after its published prompt format: ]~!b[]~b]ROLE headers, every message
# closed by [e~[, the tools as <tool> JSON lines in the system turn; an assistant turn's thinking
# (after the last user message only) in <think>...</think>, its calls as <invoke>s in one
# <minimax:tool_call> block, strings raw and other values as JSON; a run of tool results in one
# ]~b]tool message of <response>s. The generation prompt opens the thinking.
MINIMAX_M2_SPECIALS = ["]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"]
MINIMAX_M2_STYLE_TEMPLATE = (   # no whitespace control: every newline written is in the text or an expression
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "]~!b[]~b]system\n{{ messages[0].content if messages and messages[0].role == 'system' "
    "else 'You are a helpful assistant.' }}"
    "{% if tools %}{{ '\n\n# Tools\n<tools>' }}{% for t in tools %}{{ '\n<tool>' }}{{ t.function | tojson }}</tool>"
    "{% endfor %}{{ '\n</tools>\nCall tools as <minimax:tool_call><invoke name=\"NAME\"><parameter name=\"KEY\">'"
    " + 'VALUE</parameter></invoke></minimax:tool_call>' }}{% endif %}[e~[{{ '\n' }}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}]~b]user{{ '\n' }}{{ m.content }}[e~[{{ '\n' }}"
    "{% elif m.role == 'assistant' %}]~b]ai{{ '\n' }}"
    "{% if m.get('reasoning_content') and loop.index0 > ns.last_user %}"
    "<think>{{ '\n' + m.reasoning_content + '\n' }}</think>{{ '\n\n' }}{% endif %}{{ m.content or '' }}"
    "{% if m.get('tool_calls') %}{{ '\n<minimax:tool_call>\n' }}{% for tc in m.tool_calls %}"
    "<invoke name=\"{{ tc.function.name }}\">{{ '\n' }}{% for k, v in tc.function.arguments.items() %}"
    "<parameter name=\"{{ k }}\">{{ v if v is string else v | tojson }}</parameter>{{ '\n' }}{% endfor %}"
    "</invoke>{{ '\n' }}{% endfor %}</minimax:tool_call>{% endif %}[e~[{{ '\n' }}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}]~b]tool{% endif %}"
    "{{ '\n<response>' }}{{ m.content }}</response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}[e~[{{ '\n' }}{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai{{ '\n<think>\n' }}{% endif %}"
)

# DeepSeek-V3.2, written after its published encoding: the DSML token kept in a variable, the tools
# and the call syntax in the system prompt, <｜User｜>...<｜Assistant｜> then <think> for the last
# user message (</think> for earlier ones); an assistant turn is its reasoning (after the last
# user message) and </think>, its content, then its calls as DSML invokes, strings marked
# string="true", other values JSON; the results follow in <function_results>, then <think> again.
DEEPSEEK_V32_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                         "</think>", "｜DSML｜"]
DEEPSEEK_V32_STYLE_TEMPLATE = (   # no whitespace control, as above
    "{% set dsml = '｜DSML｜' %}{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{{ bos_token }}{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}{{ '\n\n## Tools\nCall functions in a <' + dsml + 'function_calls> block of <' + dsml }}"
    "invoke name=\"NAME\"> elements, each parameter <{{ dsml }}parameter name=\"KEY\" string=\"true|false\">"
    "VALUE</{{ dsml }}parameter>.{{ '\n<functions>' }}{% for t in tools %}{{ '\n' }}{{ t | tojson }}{% endfor %}"
    "{{ '\n</functions>\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<｜User｜>{{ m.content }}<｜Assistant｜>"
    "{{ '<think>' if loop.index0 == ns.last_user else '</think>' }}"
    "{% elif m.role == 'assistant' %}"
    "{% if loop.index0 > ns.last_user %}{{ m.get('reasoning_content') or '' }}</think>{% endif %}"
    "{{ m.content or '' }}"
    "{% if m.get('tool_calls') %}{{ '\n\n<' + dsml + 'function_calls>' }}{% for tc in m.tool_calls %}"
    "{{ '\n<' + dsml }}invoke name=\"{{ tc.function.name }}\">"
    "{% for k, v in tc.function.arguments.items() %}{{ '\n<' + dsml }}parameter name=\"{{ k }}\" "
    "string=\"{{ 'true' if v is string else 'false' }}\">{{ v if v is string else v | tojson }}</{{ dsml }}parameter>"
    "{% endfor %}{{ '\n</' + dsml + 'invoke>' }}{% endfor %}{{ '\n</' + dsml + 'function_calls>' }}{% endif %}"
    "{{ eos_token }}"
    "{% elif m.role == 'tool' %}"
    "{% if messages[loop.index0 - 1].role != 'tool' %}{{ '\n\n<function_results>' }}{% endif %}"
    "{{ '\n<result>' }}{{ m.content }}</result>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '\n</function_results>\n\n' }}"
    "{{ '<think>' if loop.index0 >= ns.last_user else '</think>' }}{% endif %}"
    "{% endif %}{% endfor %}"
)

# ByteDance Seed-OSS, written after its published prompt format: <seed:bos>ROLE\n...<seed:eos>
# messages, the tools in the system turn with the call syntax; an assistant turn's thinking in
# <seed:think>...</seed:think>, its content, then each call as Qwen3-Coder XML in its own
# <seed:tool_call> block, non-string values as Python's str of them; results as `tool` messages.
SEED_OSS_SPECIALS = ["<seed:bos>", "<seed:eos>", "<seed:pad>", "<seed:think>", "</seed:think>", "<seed:tool_call>",
                     "</seed:tool_call>"]
SEED_OSS_STYLE_TEMPLATE = (   # no whitespace control, as above
    "{% if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = 'You are a helpful assistant.' %}{% set rest = messages %}{% endif %}"
    "<seed:bos>system{{ '\n' + system }}"
    "{% if tools %}{{ '\n\nTools:' }}{% for t in tools %}{{ '\n' }}{{ t.function | tojson }}{% endfor %}"
    "{{ '\nCall them as:\n<seed:tool_call>\n<function=NAME>\n<parameter=KEY>VALUE</parameter>\n</function>\n'"
    " + '</seed:tool_call>' }}{% endif %}<seed:eos>"
    "{% for m in rest %}"
    "{% if m.role == 'assistant' %}<seed:bos>assistant"
    "{% if m.get('reasoning_content') %}{{ '\n<seed:think>' + m.reasoning_content + '</seed:think>' }}{% endif %}"
    "{% if m.content %}{{ '\n' + m.content }}{% endif %}"
    "{% for tc in m.get('tool_calls') or [] %}{{ '\n<seed:tool_call>\n<function=' + tc.function.name + '>\n' }}"
    "{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>{{ v if v is string else v | string }}"
    "{{ '</parameter>\n' }}{% endfor %}{{ '</function>\n</seed:tool_call>' }}{% endfor %}<seed:eos>"
    "{% else %}<seed:bos>{{ m.role + '\n' + m.content }}<seed:eos>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<seed:bos>assistant{{ '\n' }}{% endif %}"
)

def _build(directory: Path, specials: list[str], config: dict, eos_list: list[str] | None) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, **config}))
    if eos_list is not None:
        (directory / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": [tok.token_to_id(t) for t in eos_list]}))
    return directory


def build_llama3_style_tokenizer(directory: Path, generation_config: bool = True) -> Path:
    """Llama 3.1 Instruct's layout: eos <|eot_id|> in tokenizer_config.json; <|eom_id|> (the end of
    a turn that calls a tool) only in generation_config.json."""
    return _build(directory, LLAMA3_SPECIALS,
                  {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_STYLE_TEMPLATE},
                  ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"] if generation_config else None)


# Llama 4's JSON tool prompt: the same turns, each call a {"name": ..., "parameters": ...} object,
# one after another.
LLAMA4_JSON_STYLE_TEMPLATE = (
    LLAMA4_PYTHONIC_STYLE_TEMPLATE
    .replace("Call functions in the exact format [func_name1(param1=value1, param2=value2), func_name2(...)].",
             'Call a function with a JSON object {"name": function name, "parameters": its arguments}.')
    .replace("{{- m.content or '' }}["
             "{%- for tc in m.tool_calls %}{{ tc.function.name }}("
             "{%- for k, v in tc.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}"
             "{%- endfor %}){% if not loop.last %}, {% endif %}{%- endfor %}]<|eot|>",
             "{{- m.content or '' }}{%- for tc in m.tool_calls %}{\"name\": \"{{ tc.function.name }}\", "
             "\"parameters\": {{ tc.function.arguments | tojson }}}{%- endfor %}<|eot|>"))


def build_llama4_pythonic_style_tokenizer(directory: Path, template: str = LLAMA4_PYTHONIC_STYLE_TEMPLATE) -> Path:
    """Llama 4 Instruct's layout: eos <|eot|> in tokenizer_config.json; <|eom|> (the end of a turn
    that calls a tool) and <|end_of_text|> in generation_config.json. `template`: the pythonic
    prompt, or LLAMA4_JSON_STYLE_TEMPLATE."""
    return _build(directory, LLAMA4_SPECIALS,
                  {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>", "chat_template": template},
                  ["<|end_of_text|>", "<|eom|>", "<|eot|>"])


def build_harmony_style_tokenizer(directory: Path, generation_config: bool = True) -> Path:
    """gpt-oss's layout: eos <|return|>; its template closes past turns with <|end|>; <|call|>
    (the end of a turn that calls a tool) only in generation_config.json."""
    return _build(directory, HARMONY_SPECIALS,
                  {"eos_token": "<|return|>", "pad_token": "<|endoftext|>", "chat_template": HARMONY_STYLE_TEMPLATE},
                  ["<|return|>", "<|endoftext|>", "<|call|>"] if generation_config else None)


def build_granite_style_tokenizer(directory: Path) -> Path:
    """Granite 3's layout: eos <|end_of_text|>, which ends every turn."""
    return _build(directory, GRANITE_SPECIALS,
                  {"eos_token": "<|end_of_text|>", "chat_template": GRANITE_STYLE_TEMPLATE}, ["<|end_of_text|>"])


def build_olmo3_style_tokenizer(directory: Path) -> Path:
    """OLMo 3 Instruct's layout: eos <|endoftext|>; generation_config.json lists it and <|im_end|>."""
    return _build(directory, OLMO3_SPECIALS, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                                              "chat_template": OLMO3_STYLE_TEMPLATE}, ["<|endoftext|>", "<|im_end|>"])


def build_deepseek_style_tokenizer(directory: Path) -> Path:
    """DeepSeek V3 / R1's layout: bos <｜begin▁of▁sentence｜>, eos <｜end▁of▁sentence｜>, which ends
    every assistant turn."""
    return _build(directory, DEEPSEEK_SPECIALS, {"bos_token": "<｜begin▁of▁sentence｜>",
                                                 "eos_token": "<｜end▁of▁sentence｜>",
                                                 "chat_template": DEEPSEEK_STYLE_TEMPLATE}, ["<｜end▁of▁sentence｜>"])


def build_kimi_k2_style_tokenizer(directory: Path) -> Path:
    """Kimi K2's layout: eos [EOS], which no turn writes; generation_config.json stops on
    <|im_end|>, which ends every message."""
    return _build(directory, KIMI_K2_SPECIALS, {"bos_token": "[BOS]", "eos_token": "[EOS]",
                                                "chat_template": KIMI_K2_STYLE_TEMPLATE}, ["<|im_end|>"])

def build_minimax_m2_style_tokenizer(directory: Path) -> Path:
    """MiniMax-M2's layout: eos [e~[, which closes every message."""
    return _build(directory, MINIMAX_M2_SPECIALS, {"eos_token": "[e~[", "chat_template": MINIMAX_M2_STYLE_TEMPLATE},
                  ["[e~["])


def build_deepseek_v32_style_tokenizer(directory: Path) -> Path:
    """DeepSeek-V3.2's layout: bos <｜begin▁of▁sentence｜>, eos <｜end▁of▁sentence｜>, which ends
    every assistant turn."""
    return _build(directory, DEEPSEEK_V32_SPECIALS, {"bos_token": "<｜begin▁of▁sentence｜>",
                                                     "eos_token": "<｜end▁of▁sentence｜>",
                                                     "chat_template": DEEPSEEK_V32_STYLE_TEMPLATE},
                  ["<｜end▁of▁sentence｜>"])

def build_seed_oss_style_tokenizer(directory: Path) -> Path:
    """Seed-OSS's layout: bos <seed:bos>, eos <seed:eos>, which closes every message."""
    return _build(directory, SEED_OSS_SPECIALS, {"bos_token": "<seed:bos>", "eos_token": "<seed:eos>",
                                                 "pad_token": "<seed:pad>", "chat_template": SEED_OSS_STYLE_TEMPLATE},
                  ["<seed:eos>"])

def build_glm45_style_tokenizer(directory: Path) -> Path:
    """GLM-4.5's layout: eos <|endoftext|>; generation_config.json lists it, <|user|> and
    <|observation|> (the tokens a turn ends with)."""
    return _build(directory, GLM45_SPECIALS, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                                              "chat_template": GLM45_STYLE_TEMPLATE},
                  ["<|endoftext|>", "<|user|>", "<|observation|>"])


def build_smollm3_style_tokenizer(directory: Path) -> Path:
    """SmolLM3's layout: eos <|im_end|>, which ends every turn."""
    return _build(directory, SMOLLM3_SPECIALS, {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                                                "chat_template": SMOLLM3_STYLE_TEMPLATE}, ["<|im_end|>"])


def build_gemma3_style_tokenizer(directory: Path) -> Path:
    """Gemma 3's layout: eos <eos>; <end_of_turn> ends a turn (generation_config.json lists both)."""
    return _build(directory, GEMMA3_SPECIALS, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                                               "chat_template": GEMMA3_STYLE_TEMPLATE}, ["<eos>", "<end_of_turn>"])


def build_mistral_style_tokenizer(directory: Path, template: str = MISTRAL_STYLE_TEMPLATE) -> Path:
    """Mistral 7B v0.3's layout (tokenizer v3): tools before the last user turn, calls as a JSON
    list after [TOOL_CALLS] with 9-character ids the template checks, results in [TOOL_RESULTS],
    user and assistant turns checked to alternate (tool results and call turns not counted), the
    system prompt in the user message only while that is the conversation's last message; turns
    end with eos </s>; no generation prompt."""
    return _build(directory, MISTRAL_SPECIALS,
                  {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "chat_template": template},
                  None)


def qwen3_xml_call(name: str, **params) -> str:
    """A Qwen3-Coder XML tool call, as the model writes it (the 'qwen3_xml' format)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"
