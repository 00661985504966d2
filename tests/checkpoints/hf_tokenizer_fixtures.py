"""A small HF tokenizer directory with a Qwen3-style tool-calling chat template, built offline:
a byte-level BPE trained with `tokenizers` on a few lines, the chat-format tokens added.

    build_qwen3_style_tokenizer(directory)   # writes tokenizer.json + tokenizer_config.json
"""
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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



def build_qwen3_style_tokenizer(directory: Path, template: str | None = QWEN3_STYLE_TEMPLATE,
                                corpus=None) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus or CORPUS, trainer)
    tok.add_tokens(TOOL_TOKENS)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": None, "model_max_length": 4096}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
