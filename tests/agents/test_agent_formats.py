"""Tool-call parsing for each format (valid, malformed, nested, several per turn) and the schema check."""
import pytest

from sfrrl_jax.agents.formats.registry import CompactFormat, HarmonyFormat, ParsedTurn, Qwen3Format, get_format
from sfrrl_jax.agents.protocols import ToolCall, ToolCallError
from sfrrl_jax.agents.schema import validate

NESTED = {"query": {"filters": [{"field": "a", "op": "}"}, {"field": "b</tool_call>", "n": [1, 2, {"x": None}]}]},
          "flag": True}


def test_compact_several_calls_and_nested_json():
    text = ('Let me compute.<|call|>calculator{"expression":"2*3"}<|/call|>'
            '<|call|>search{"query":{"filters":[{"field":"a","op":"}"}]},"flag":true}<|/call|><|end|>')
    parsed = CompactFormat().parse(text)
    assert parsed.content == "Let me compute."
    assert parsed.calls == (
        ToolCall("calculator", {"expression": "2*3"}, "call_0", '<|call|>calculator{"expression":"2*3"}<|/call|>'),
        ToolCall("search", {"query": {"filters": [{"field": "a", "op": "}"}]}, "flag": True}, "call_1",
                 '<|call|>search{"query":{"filters":[{"field":"a","op":"}"}]},"flag":true}<|/call|>'))


def test_compact_answer_without_calls():
    parsed = CompactFormat().parse("So the answer is <answer>42</answer><|end|>")
    assert (parsed.content, parsed.calls) == ("So the answer is <answer>42</answer>", ())


@pytest.mark.parametrize("body, message", [
    ('calculator{"expression": 2*3}', "malformed tool call JSON in arguments of 'calculator': Expecting ',' delimiter"),
    ('calculator{"expression":"1"} trailing', "unexpected text after the JSON object"),
    ('{"expression":"1"}', "tool call has no valid tool name (got '')"),
    ("calculator", "tool call has no JSON arguments object"),
    ('bad name{"a":1}', "tool call has no valid tool name (got 'bad name')"),
])
def test_compact_malformed_calls_become_errors(body, message):
    parsed = CompactFormat().parse(f"x<|call|>{body}<|/call|><|call|>ok{{}}<|/call|><|end|>")
    assert len(parsed.calls) == 2
    error, ok = parsed.calls
    assert isinstance(error, ToolCallError) and error.message.startswith(message), error.message
    assert ok == ToolCall("ok", {}, "call_1", "<|call|>ok{}<|/call|>")


def test_compact_unterminated_call():
    parsed = CompactFormat().parse('a<|call|>calculator{"expression":"1"')
    assert parsed.content == "a"
    assert [type(c) for c in parsed.calls] == [ToolCallError]
    assert parsed.calls[0].message == "unterminated tool call: missing <|/call|>"


def test_qwen3_valid_nested_and_several():
    import json
    text = ("<think>plan</think>Checking.\n<tool_call>\n"
            + json.dumps({"name": "search", "arguments": NESTED}) + "\n</tool_call>\n<tool_call>\n"
            '{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}\n</tool_call><|im_end|>')
    parsed = Qwen3Format().parse(text)
    assert parsed.content == "Checking." and parsed.reasoning == "plan"
    assert [(c.name, c.arguments, c.call_id) for c in parsed.calls] == [
        ("search", NESTED, "call_0"), ("calculator", {"expression": "1+1"}, "call_1")]


def test_qwen3_thinking_is_split_off_before_calls_are_parsed():
    # the reported case: a thought that mentions <tool_call> is not a call, and the answer survives
    parsed = Qwen3Format().parse('<think>\nI might use <tool_call> later\n</think>\n\nDone.')
    assert parsed.calls == () and parsed.content == "Done."
    assert parsed.reasoning == "I might use <tool_call> later"
    # the template opened <think> in the prompt: the turn starts inside the thought
    parsed = Qwen3Format().parse('step 1 <tool_call>{"name": "x"}</tool_call></think>'
                                 '<tool_call>{"name": "calc", "arguments": {"a": 1}}</tool_call><|im_end|>')
    assert [c.name for c in parsed.calls] == ["calc"] and parsed.content == ""
    assert parsed.reasoning.startswith("step 1")
    # out of tokens while thinking: all reasoning, no call, no answer
    parsed = Qwen3Format().parse('<think>maybe <tool_call>{"name": "calc", "arguments": {}}</tool_call>')
    assert parsed.calls == () and parsed.content == "" and parsed.reasoning.startswith("maybe")
    # no thinking block: unchanged
    assert Qwen3Format().parse("plain answer<|im_end|>") == ParsedTurn(content="plain answer")


def test_qwen3_errors():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1,}}</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": [1]}</tool_call>'
            '<tool_call>["not", "an", "object"]</tool_call><tool_call>{"name": "c"')
    calls = Qwen3Format().parse(text).calls
    assert all(isinstance(c, ToolCallError) for c in calls) and len(calls) == 5
    assert calls[0].message.startswith("malformed tool call JSON in <tool_call>")
    assert calls[1].message == "tool call has no valid tool name (got None)"
    assert calls[2].message == "arguments of 'b' must be a JSON object, got list" and calls[2].name == "b"
    assert calls[3].message == "<tool_call> must be a JSON object, got list"
    assert calls[4].message == "unterminated tool call: missing </tool_call>"


def test_harmony_reasoning_calls_and_final():
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"location": "San Francisco", "units": {"t": "C"}}<|call|>')
    parsed = HarmonyFormat().parse(text)
    assert parsed.reasoning == "Need the weather."
    assert parsed.content == ""
    assert parsed.calls == (ToolCall("get_weather", {"location": "San Francisco", "units": {"t": "C"}}, "call_0",
                                     parsed.calls[0].raw),)
    final = HarmonyFormat().parse("<|channel|>final<|message|>It is <answer>20</answer>.<|return|>")
    assert (final.content, final.calls) == ("It is <answer>20</answer>.", ())


def test_harmony_recipient_in_role_and_several_calls_and_errors():
    text = ('<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x": 1}<|call|>'
            '<|start|>assistant to=functions.b<|channel|>commentary json<|message|>{"y": [1, {"z": 2}]}<|call|>'
            '<|start|>assistant<|channel|>commentary to=functions.c <|constrain|>json<|message|>{oops}<|call|>'
            '<|start|>assistant<|channel|>commentary to=functions.d <|constrain|>json<|message|>{"x": 1')
    calls = HarmonyFormat().parse(text).calls
    assert [(c.name, c.arguments) for c in calls[:2]] == [("a", {"x": 1}), ("b", {"y": [1, {"z": 2}]})]
    assert isinstance(calls[2], ToolCallError) and calls[2].name == "c"
    assert calls[2].message.startswith("malformed tool call JSON in arguments of 'c'")
    assert isinstance(calls[3], ToolCallError) and calls[3].message == "unterminated tool call: missing <|call|>"


def test_get_format():
    assert isinstance(get_format("qwen3"), Qwen3Format)
    with pytest.raises(ValueError, match="unknown tool-call format 'nope'"):
        get_format("nope")


def test_schema_validation_names_paths():
    schema = {"type": "object", "additionalProperties": False, "required": ["expression", "n"],
              "properties": {"expression": {"type": "string", "maxLength": 5},
                             "n": {"type": "integer", "minimum": 0},
                             "mode": {"enum": ["a", "b"]},
                             "xs": {"type": "array", "items": {"type": "number"}}}}
    assert validate({"expression": "1+1", "n": 3, "xs": [1, 2.5]}, schema) == []
    assert validate({"expression": 5, "n": True, "mode": "c", "xs": [1, "2"], "extra": 1}, schema) == [
        "arguments.expression: expected string, got integer",
        "arguments.n: expected integer, got boolean",
        "arguments: 'c' is not one of ['a', 'b']".replace("arguments:", "arguments.mode:"),
        "arguments.xs[1]: expected number, got string",
        "arguments: unexpected property 'extra' (allowed: ['expression', 'mode', 'n', 'xs'])"]
    assert validate({"n": -1}, schema) == ["arguments: missing required property 'expression'",
                                           "arguments.n: -1 is below the minimum 0"]
    assert validate([], schema) == ["arguments: expected object, got array"]
