"""Tool-call formats: how a model writes tool calls in its generated text, and how they are read
back (`parse(text)`: a turn's content, reasoning and calls, never raising on model output).

`registry.py` holds the `ToolCallFormat` protocol, the JSON / XML / harmony / Mistral / Granite
formats, the registry of built-in names (`get_format`) and `infer_format` (the format a chat
template writes); `deepseek.py` DeepSeek's and Kimi K2's delimited sections, `invoke.py`
MiniMax-M2's and DeepSeek-V3.2's XML invokes, `pythonic.py` Python-call lists (Llama 3.2 / 4,
OLMo 3), `call_text.py` the readers they share. This room needs only the agents' protocols and
the tokenizer's chat-template reader: it imports nothing from the tasks, the sandbox or the loop.
"""
from sfrrl_jax.agents.formats.call_text import ParsedTurn
from sfrrl_jax.agents.formats.deepseek import DeepSeekFormat, KimiK2Format
from sfrrl_jax.agents.formats.invoke import DeepSeekDsmlFormat, MiniMaxM2Format
from sfrrl_jax.agents.formats.pythonic import Olmo3Format, PythonicFormat
from sfrrl_jax.agents.formats.registry import (CompactFormat, Glm45Format, GraniteFormat, HarmonyFormat,
                                               Llama3JsonFormat, Llama4JsonFormat, MistralFormat, Qwen3Format,
                                               Qwen3XmlFormat, SeedOssFormat, ToolCallFormat, get_format,
                                               infer_format)

__all__ = ["CompactFormat", "DeepSeekDsmlFormat", "DeepSeekFormat", "Glm45Format", "GraniteFormat", "HarmonyFormat",
           "KimiK2Format", "Llama3JsonFormat", "Llama4JsonFormat", "MiniMaxM2Format", "MistralFormat", "Olmo3Format",
           "ParsedTurn", "PythonicFormat", "Qwen3Format", "Qwen3XmlFormat", "SeedOssFormat", "ToolCallFormat",
           "get_format", "infer_format"]
