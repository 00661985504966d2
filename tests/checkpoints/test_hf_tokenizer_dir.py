"""An HF tokenizer directory next to the weights: `sfrrl_jax.tokenizer.load_tokenizer` renders a
tool-calling conversation with the directory's own (Qwen3-style) chat template, token for token
as transformers does.

The directory is built offline: a byte-level BPE trained with `tokenizers` on a few lines, the
chat-format tokens added, and a chat template in the Qwen3 format (system + tools block,
<tool_call> JSON in assistant turns, tool results wrapped in <tool_response> inside user turns).
"""
import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from sfrrl_jax.tokenizer import load_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

QWEN3_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{% if m.content %}{{ m.content }}\n{% endif %}"
    "{% for tc in m.tool_calls %}{% if not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}{{ '\\n' }}"
    "<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# (HF renders with trim_blocks: a newline right after a block tag is dropped, hence {{ '\\n' }}.)

CORPUS = [
    "What is the weather in Paris today?",
    "The weather in Paris is sunny, 21 degrees.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "You are a helpful assistant. Use the tools when they help.",
    "def add(a, b): return a + b  # 1 2 3 4 5 6 7 8 9 0",
] * 20

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
    {"role": "tool", "content": '{"temperature": 21, "sky": "sunny"}'},
    {"role": "assistant", "content": "It is sunny in Paris, 21 degrees."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(TOOL_TOKENS)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": QWEN3_STYLE_TEMPLATE, "model_max_length": 4096}))
    return directory


def test_load_tokenizer_renders_a_tool_calling_conversation_like_transformers(tokenizer_dir):
    ours = load_tokenizer(tokenizer_dir)
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    text = ours.render(CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    ref_text = reference.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text == ref_text
    # The structure a tool-calling trajectory relies on is really there.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = ours.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert ids == reference(ref_text, add_special_tokens=False)["input_ids"]
    for token in SPECIAL[1:] + TOOL_TOKENS:  # each chat-format token is one id, never split
        assert ids.count(ours.token_to_id(token)) == text.count(token), token
    assert ours.decode(ids) == text
    assert ours.end_of_turn_token == "<|im_end|>" and ours.eos_id == ours.token_to_id("<|im_end|>")
