"""An HF tokenizer directory next to the weights: `sfrrl_jax.tokenizer.load_tokenizer` renders a
tool-calling conversation with the directory's own (Qwen3-style) chat template, token for token
as transformers does.

The directory is built offline: a byte-level BPE trained with `tokenizers` on a few lines, the
chat-format tokens added, and a chat template in the Qwen3 format (system + tools block,
<tool_call> JSON in assistant turns, tool results wrapped in <tool_response> inside user turns).
"""
import pytest
from transformers import AutoTokenizer

from sfrrl_jax.tokenizer import load_tokenizer

from hf_tokenizer_fixtures import SPECIAL, TOOL_TOKENS, build_qwen3_style_tokenizer

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
    return build_qwen3_style_tokenizer(tmp_path_factory.mktemp("tok"))


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
