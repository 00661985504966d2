"""Kimi K2's tool calls (`KimiK2Format`): parsing, hostile turns, and the agent loop and SFT over a
template written after Kimi K2's published prompt format (family_tokenizer_fixtures)."""
import time

import pytest

from sfrrl_jax.agents import KimiK2Format, ParsedTurn
from sfrrl_jax.agents.formats.registry import get_format, infer_format
from sfrrl_jax.tokenizer import load_tokenizer

_SECTION, _SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_CB, _ARGS, _CE, _END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_end|>"


def _call(call_id, arguments):
    return f"{_CB}{call_id}{_ARGS}{arguments}{_CE}"


def test_kimi_calls_keep_their_ids_and_name_their_tools():
    parse = KimiK2Format().parse
    turn = parse("<think>use the tool</think>Let me compute." + _SECTION
                 + _call("functions.calculator:0", '{"expression": "2 + 3"}') + "\n"
                 + _call(" functions.search:1 ", '{"q": "x", "n": [1, 2]}') + _call("lookup", "{}")
                 + _SECTION_END + _END)
    assert (turn.reasoning, turn.content) == ("use the tool", "Let me compute.")
    assert [(c.name, c.arguments, c.call_id) for c in turn.calls] == [
        ("calculator", {"expression": "2 + 3"}, "functions.calculator:0"),
        ("search", {"q": "x", "n": [1, 2]}, "functions.search:1"),
        ("lookup", {}, "lookup")]   # a bare name, as K2 sometimes writes: the id is what it wrote
    assert parse("<think></think><answer>5</answer>" + _END) == ParsedTurn("<answer>5</answer>")
    # a bad call is an error in its place, the good ones stand
    mixed = parse(_SECTION + _call("functions.f:0", '{"a": 1') + _call("functions.g:1", '{"b": 2}') + _SECTION_END)
    assert [type(c).__name__ for c in mixed.calls] == ["ToolCallError", "ToolCall"] and mixed.calls[0].name == "f"
    for text, why in ((_SECTION + _SECTION_END, "without a call"),
                      (_SECTION + _CB + "functions.f:0" + _ARGS + "{}", "unterminated"),
                      (_SECTION + _CB + "functions.f:0 {}" + _CE + _SECTION_END, f"without {_ARGS}"),
                      (_SECTION + _call("", "{}") + _SECTION_END, "no valid tool name"),
                      (_SECTION + _call("functions.a b:0", "{}") + _SECTION_END, "no valid tool name"),
                      (_SECTION + _call("functions.f:0", "[1]") + _SECTION_END, "must be a JSON object"),
                      (_SECTION + _call("functions.f:0", "{}") + _SECTION_END + "more", "unexpected text after")):
        assert any(why in e.message for e in parse(text).errors), (text, parse(text))
    assert infer_format("{{ '<|tool_calls_section_begin|>' }}") == "kimi_k2"
    assert get_format("kimi_k2") == KimiK2Format()
    for text in (_SECTION + _CB * 50000, _SECTION + _call("functions.f:0", "{") * 30000,
                 _SECTION + _call("functions." + "f:1" * 50000, "{}"), _SECTION + _call("f", "[" * 100000)):
        start = time.perf_counter()
        assert isinstance(parse(text), ParsedTurn) and time.perf_counter() - start < 10


def test_kimi_tool_loop_and_sft_over_a_kimi_style_template(tmp_path):
    from sfrrl_jax.agents import calculator_demonstration, calculator_tool_schemas
    from sfrrl_jax.agents.tasks.demos import render_sft_example
    from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
    from family_tokenizer_fixtures import KIMI_K2_STYLE_TEMPLATE, build_kimi_k2_style_tokenizer
    from test_model_formats import _calculator_loop

    tok = load_tokenizer(build_kimi_k2_style_tokenizer(tmp_path))
    assert infer_format(tok.chat_template_source) == infer_format(KIMI_K2_STYLE_TEMPLATE) == "kimi_k2"
    observation = _calculator_loop(tok, ["<think>add them</think>" + _SECTION
                                         + _call("functions.calculator:0", '{"expression": "2 + 3"}') + _SECTION_END
                                         + _END, "<think></think><answer>5</answer>" + _END])
    # the result is headed by the call's own id; then the next generation prompt
    assert observation == ("<|im_system|>calculator<|im_middle|>## Return of functions.calculator:0\n5" + _END
                           + "<|im_assistant|>assistant<|im_middle|>")
    demo = calculator_demonstration(arithmetic_task("2 + 3 - 1", "t"), call_id="functions.calculator:0")
    tokens, mask = render_sft_example(tok, demo, calculator_tool_schemas())
    learned = tok.decode([t for t, m in zip(tokens, mask) if m])
    assert "<think></think>" + _SECTION + _call("functions.calculator:0", '{"expression": "5 - 1"}') \
        + _SECTION_END + _END in learned
    assert learned.endswith("<think></think><answer>4</answer>" + _END)
    assert tokens == tok.apply_chat_template(demo, calculator_tool_schemas())
    # ids the model would not write read as tool names, and the error says so
    with pytest.raises(ValueError, match=r"reads as \['call_0\(.*ids the model writes \(Kimi K2's: 'functions"):
        render_sft_example(tok, calculator_demonstration(arithmetic_task("2 + 3", "t")), calculator_tool_schemas())
