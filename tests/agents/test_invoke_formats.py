"""MiniMax-M2's and DeepSeek-V3.2's (DSML) tool calls: XML invokes in one block. Parsing, hostile
turns, and the agent loop and SFT over templates written after the published prompt formats
(family_tokenizer_fixtures)."""
import time

import pytest

from sfrrl_jax.agents import ParsedTurn
from sfrrl_jax.agents.formats.registry import get_format, infer_format
from sfrrl_jax.agents.formats.invoke import DeepSeekDsmlFormat, MiniMaxM2Format
from sfrrl_jax.tokenizer import load_tokenizer

_TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {
    "expression": {"type": "string"}, "digits": {"type": "integer"}, "exact": {"type": "boolean"}}}}}]
_MM_END, _DS_END = "[e~[", "<｜end▁of▁sentence｜>"
_D = "｜DSML｜"


def _mm(*invokes):
    return "\n<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


def _mm_invoke(name, **params):
    return f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n'
                                                 for k, v in params.items()) + "</invoke>\n"


def _ds(*invokes):
    return f"\n\n<{_D}function_calls>" + "".join(invokes) + f"\n</{_D}function_calls>"


def _ds_invoke(name, **params):   # params: key -> (text, is_string)
    return (f'\n<{_D}invoke name="{name}">' + "".join(f'\n<{_D}parameter name="{k}" string="{str(s).lower()}">{v}'
                                                      f"</{_D}parameter>" for k, (v, s) in params.items())
            + f"\n</{_D}invoke>")


def test_minimax_invokes_read_by_their_schemas():
    parse = MiniMaxM2Format().with_tools(_TOOLS).parse
    turn = parse("use the tool\n</think>\n\nLet me compute." + _mm(
        _mm_invoke("calc", expression="2 + 3", digits=4, exact="true"), _mm_invoke("calc", expression="42")) + _MM_END)
    assert (turn.reasoning, turn.content) == ("use the tool", "Let me compute.")
    assert [(c.name, c.arguments, c.call_id) for c in turn.calls] == [
        ("calc", {"expression": "2 + 3", "digits": 4, "exact": True}, "call_0"),
        ("calc", {"expression": "42"}, "call_1")]   # a string by its schema, though it reads as JSON
    assert MiniMaxM2Format().parse(_mm(_mm_invoke("calc", expression="42"))).calls[0].arguments == {"expression": 42}
    assert parse("\n</think>\n\n<answer>5</answer>" + _MM_END) == ParsedTurn("<answer>5</answer>")
    mixed = parse(_mm(_mm_invoke("calc", expression="1") + "<invoke name=\"calc\">\n<parameter name=\"x\">1"
                      "</invoke>\n", _mm_invoke("calc", expression="2")))
    assert [type(c).__name__ for c in mixed.calls] == ["ToolCall", "ToolCallError", "ToolCall"]
    for text, why in ((_mm(), "holds no invoke"), (_mm("stray " + _mm_invoke("calc")), "text outside an invoke"),
                      (_mm('<invoke name="calc">\n'), "unterminated invoke"),
                      (_mm(_mm_invoke("calc", a=1, b=2).replace('"b"', '"a"')), "given twice"),
                      (_mm(_mm_invoke("calc").replace("</invoke>", "oops</invoke>")), "unexpected text"),
                      (_mm(_mm_invoke("a b")), "no valid tool name"),
                      ("<minimax:tool_call>" + _mm_invoke("calc"), "unterminated tool call")):
        assert any(why in e.message for e in parse(text).errors), (text, parse(text))
    assert infer_format("{%- set toolcall_begin_token = '<minimax:tool_call>' -%}") == "minimax_m2"
    assert get_format("minimax_m2") == MiniMaxM2Format()


def test_dsml_invokes_say_which_values_are_strings():
    parse = DeepSeekDsmlFormat().parse
    turn = parse("think it over</think>Let me." + _ds(
        _ds_invoke("calc", expression=("2 + 3", True), digits=("4", False), opts=('{"a": [1, null]}', False)),
        _ds_invoke("calc", expression=("[1]", True))) + _DS_END)
    assert (turn.reasoning, turn.content) == ("think it over", "Let me.")
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("calc", {"expression": "2 + 3", "digits": 4, "opts": {"a": [1, None]}}), ("calc", {"expression": "[1]"})]
    assert parse("</think><answer>5</answer>" + _DS_END) == ParsedTurn("<answer>5</answer>")
    assert parse(_ds(_ds_invoke("calc")) + " more").content == "more"   # text around the block is content
    for text, why in ((_ds(_ds_invoke("calc", n=("{1", False))), "malformed JSON in parameter 'n'"),
                      (_ds(_ds_invoke("calc", n=("1, 2", False))), "unexpected text after the JSON value"),
                      (_ds(_ds_invoke("calc", n=("1", "maybe"))), "malformed parameter"),
                      (_ds(_ds_invoke("calc", n=("[" * 100000, False))), "parameter 'n'")):
        assert any(why in e.message for e in parse(text).errors), (text[:200], parse(text))
    # the template keeps the DSML token in a variable: the token itself is the marker
    assert infer_format("{%- set dsml_token = \"｜DSML｜\" -%}<{{ dsml_token }}function_calls>") == "deepseek_v32"
    assert infer_format("<function_calls>") == "olmo3"   # OLMo 3's tag, without the token, is not DSML's
    assert get_format("deepseek_v32") == DeepSeekDsmlFormat()


@pytest.mark.parametrize("fmt, text", [
    (MiniMaxM2Format(), _mm(_mm_invoke("calc") * 20000)),
    (MiniMaxM2Format(), ("<minimax:tool_call>" + '<invoke name="' * 3) * 10000),
    (MiniMaxM2Format(), _mm('<invoke name="calc">\n' + '<parameter name="' * 30000 + "</invoke>\n")),
    (DeepSeekDsmlFormat(), _ds(_ds_invoke("f", a=("1", False)) * 20000)),
    (DeepSeekDsmlFormat(), (f"<{_D}function_calls>" + f"</{_D}function_calls>") * 20000),
])
def test_hostile_invoke_turns_parse_in_linear_time(fmt, text):
    start = time.perf_counter()
    assert isinstance(fmt.parse(text), ParsedTurn) and time.perf_counter() - start < 10


def _reasoned(messages):
    """The transcript with reasoning on its assistant turns (templates that open the thinking in
    the generation prompt render a turn after it only with some)."""
    return [{**m, "reasoning_content": "I add them."} if m["role"] == "assistant" else m for m in messages]


def test_minimax_tool_loop_and_sft_over_a_minimax_style_template(tmp_path):
    from sfrrl_jax.agents import calculator_demonstration, calculator_tool_schemas
    from sfrrl_jax.agents.tasks.demos import render_sft_example
    from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
    from family_tokenizer_fixtures import MINIMAX_M2_STYLE_TEMPLATE, build_minimax_m2_style_tokenizer
    from test_model_formats import _calculator_loop

    tok = load_tokenizer(build_minimax_m2_style_tokenizer(tmp_path))
    assert infer_format(tok.chat_template_source) == infer_format(MINIMAX_M2_STYLE_TEMPLATE) == "minimax_m2"
    observation = _calculator_loop(tok, ["I add them.\n</think>\n\n" + _mm(_mm_invoke("calculator", expression="2 + 3"))
                                         + _MM_END, "done\n</think>\n\n<answer>5</answer>" + _MM_END])
    assert observation == "\n]~b]tool\n<response>5</response>[e~[\n]~b]ai\n<think>\n"
    demo = _reasoned(calculator_demonstration(arithmetic_task("2 + 3 - 1", "t")))
    tokens, mask = render_sft_example(tok, demo, calculator_tool_schemas())
    learned = tok.decode([t for t, m in zip(tokens, mask) if m])
    assert "I add them.\n</think>\n\n" + _mm(_mm_invoke("calculator", expression="5 - 1")) + _MM_END in learned
    assert learned.endswith("</think>\n\n<answer>4</answer>" + _MM_END)
    # the template's render, up to the newline it writes after the last [e~[ (the next header's)
    assert tok.decode(tokens) + "\n" == tok.render(demo, calculator_tool_schemas(), add_generation_prompt=False)


def test_dsml_tool_loop_and_sft_over_a_deepseek_v32_style_template(tmp_path):
    from sfrrl_jax.agents import calculator_demonstration, calculator_tool_schemas
    from sfrrl_jax.agents.tasks.demos import render_sft_example
    from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
    from family_tokenizer_fixtures import DEEPSEEK_V32_STYLE_TEMPLATE, build_deepseek_v32_style_tokenizer
    from test_model_formats import _calculator_loop

    tok = load_tokenizer(build_deepseek_v32_style_tokenizer(tmp_path))
    assert infer_format(tok.chat_template_source) == infer_format(DEEPSEEK_V32_STYLE_TEMPLATE) == "deepseek_v32"
    call = _ds(_ds_invoke("calculator", expression=("2 + 3", True)))
    observation = _calculator_loop(tok, ["I add them.</think>" + call + _DS_END, "done</think><answer>5</answer>" + _DS_END])
    # the results, then the thinking opened again: no generation prompt, the model goes on
    assert observation == "\n\n<function_results>\n<result>5</result>\n</function_results>\n\n<think>"
    demo = _reasoned(calculator_demonstration(arithmetic_task("2 + 3 - 1", "t")))
    tokens, mask = render_sft_example(tok, demo, calculator_tool_schemas())
    learned = tok.decode([t for t, m in zip(tokens, mask) if m])
    assert "I add them.</think>" + _ds(_ds_invoke("calculator", expression=("5 - 1", True))) + _DS_END in learned
    assert learned.endswith("</think><answer>4</answer>" + _DS_END)
    assert tokens == tok.apply_chat_template(demo, calculator_tool_schemas())
