"""Tool-call formats of the model families (Llama 3 / 4 JSON, Llama 3.2 / 4 pythonic, Mistral,
Qwen3-Coder XML, gpt-oss harmony, Granite 3, OLMo 3, DeepSeek V3 / R1 / V3.1, GLM-4.5): the turn's
stop tokens (generation_config.json's, refined by the format), the parse (hostile turns
included), and the format read from the chat template. The loop over the older families'
templates is in test_template_turns.py; the newer ones' loops and SFT are here."""
import sys
import time
from pathlib import Path

import pytest

from sfrrl_jax.agents import ParsedTurn
from sfrrl_jax.agents.formats.registry import (DeepSeekFormat, Glm45Format, GraniteFormat, HarmonyFormat,
                                               Llama3JsonFormat, Llama4JsonFormat, MistralFormat, Olmo3Format,
                                               PythonicFormat, Qwen3Format, Qwen3XmlFormat, get_format, infer_format,
                                               turn_stop_ids)
from sfrrl_jax.agents.loop import AgentConfig
from sfrrl_jax.agents.protocols import ToolCall
from sfrrl_jax.tokenizer import load_tokenizer

from family_tokenizer_fixtures import (LLAMA4_JSON_STYLE_TEMPLATE, LLAMA4_PYTHONIC_STYLE_TEMPLATE,
                                      build_harmony_style_tokenizer, build_llama3_style_tokenizer, qwen3_xml_call)

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoints"))
from hf_tokenizer_fixtures import build_qwen3_style_tokenizer  # noqa: E402


def _ids(tok, *tokens):
    return [tok.token_to_id(t) for t in tokens]


def _calculator_loop(tok, turns) -> str:
    """Runs the agent loop on '2 + 3' with the scripted `turns` (a call, then the answer): it must
    end answered and rewarded, with the tool's result; returns the first observation delta."""
    import asyncio

    from sfrrl_jax.agents import calculator_environment, run_agent
    from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
    from sfrrl_jax.testing.scripted_engine import ScriptedEngine
    env = calculator_environment()
    try:
        traj = asyncio.run(run_agent(ScriptedEngine(turns, tokenizer=tok), env, arithmetic_task("2 + 3", "t0"), tok,
                                     AgentConfig(max_turns=3, max_new_tokens_per_turn=96, max_total_tokens=2048)))
    finally:
        env.close()
    assert (traj.error, traj.finish_reason, traj.reward) == (None, "answer", 1.0)
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["5"]
    return tok.decode(traj.tokens[traj.turns[0].gen_end:traj.turns[0].obs_end])


# ----------------------------------------------------------------------------- stop tokens

def test_generation_config_eos_ids_join_the_stops(llama_dir, tmp_path):
    tok = load_tokenizer(llama_dir)
    eot, eom, end = _ids(tok, "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    assert tok.end_of_turn_token == "<|eot_id|>"
    assert tok.stop_token_ids == (eot, end, eom)   # end-of-turn (= eos), then the config's others
    (tmp_path / "bare").mkdir()
    bare = build_llama3_style_tokenizer(tmp_path / "bare", generation_config=False)
    assert load_tokenizer(bare).stop_token_ids == (eot,)
    # Llama 3's format stops on <|eom_id|> with or without the file
    assert eom in turn_stop_ids(Llama3JsonFormat(), load_tokenizer(bare))


@pytest.mark.parametrize("content,match", [
    ("{not json", "not valid JSON"),
    ('["eos"]', "expected a JSON object, got list"),
    ('{"eos_token_id": "2"}', "eos_token_id '2' must be a token id"),
    ('{"eos_token_id": [1, true]}', r"eos_token_id \[1, True\] must be a token id"),
    ('{"eos_token_id": 100000}', r"in \[0, \d+\)"),
    ('{"eos_token_id": -1}', "must be a token id"),
])
def test_a_bad_generation_config_is_refused_naming_the_file_and_field(llama_dir, tmp_path, content, match):
    directory = tmp_path / "tok"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((llama_dir / name).read_bytes())
    (directory / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        load_tokenizer(directory)
    assert "generation_config.json" in str(info.value)
    (directory / "generation_config.json").write_text('{"eos_token_id": null, "do_sample": true}')
    assert load_tokenizer(directory).stop_token_ids == (load_tokenizer(directory).token_to_id("<|eot_id|>"),)


@pytest.mark.parametrize("with_generation_config", [True, False])
def test_harmony_turns_stop_on_return_and_call_never_on_end(tmp_path, with_generation_config):
    """gpt-oss closes past turns with <|end|> (so its tokenizer's end-of-turn is <|end|>), but a
    live turn writes <|end|> between its analysis and its final message: stopping there would cut
    every turn after its reasoning. With or without generation_config.json."""
    tok = load_tokenizer(build_harmony_style_tokenizer(tmp_path, generation_config=with_generation_config))
    ret, call, end = _ids(tok, "<|return|>", "<|call|>", "<|end|>")
    assert tok.end_of_turn_token == "<|end|>" and end in tok.stop_token_ids
    stops = turn_stop_ids(HarmonyFormat(), tok)
    assert ret in stops and call in stops and end not in stops
    # other formats leave the tokenizer's stops as they are (plus their own turn ends)
    assert set(tok.stop_token_ids) <= set(turn_stop_ids(Qwen3Format(), tok))


# ----------------------------------------------------------------------------- parsing

def test_llama3_json_calls_answers_and_broken_calls():
    parse = Llama3JsonFormat().parse
    one = parse('{"name": "calculator", "parameters": {"expression": "2 + 3"}}<|eom_id|>')
    assert one == ParsedTurn("", (ToolCall("calculator", {"expression": "2 + 3"}, "call_0",
                                           raw='{"name": "calculator", "parameters": {"expression": "2 + 3"}}'),))
    # one call per turn (Llama's templates refuse a message with more): the second is an error
    two = parse('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": 1}}<|eot_id|>')
    assert [(c.name, c.arguments, c.call_id) for c in two.tool_calls] == [("f", {}, "call_0")]
    assert [(e.name, e.raw) for e in two.errors] == [("g", '{"name": "g", "arguments": {"x": 1}}')]
    assert "one tool per turn" in two.errors[0].message
    assert parse("The answer is <answer>5</answer><|eot_id|>") == ParsedTurn("The answer is <answer>5</answer>")
    # a turn that starts a call is one: what cannot be read is its error observation
    broken = parse('{"name": "f", "parameters": {"a": 1}')
    assert broken.content == "" and "malformed tool call JSON" in broken.errors[0].message
    assert "no valid tool name" in parse('{"answer": 5}<|eot_id|>').errors[0].message
    assert "must be a JSON object" in parse('{"name": "f", "parameters": [1]}').errors[0].message
    assert "without a JSON tool call" in parse('<|python_tag|>brave_search.call(query="x")<|eom_id|>').errors[0].message
    first_ok = parse('{"name": "f", "parameters": {}}; {"name": ')
    assert isinstance(first_ok.calls[0], ToolCall) and "malformed" in first_ok.calls[1].message


def test_mistral_both_call_layouts_and_errors():
    parse = MistralFormat().parse
    v3 = parse('Let me compute.[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "2 + 3"}}, '
               '{"name": "g", "arguments": "{\\"x\\": 1}"}]</s>')
    assert v3.content == "Let me compute."
    assert [(c.name, c.arguments) for c in v3.calls] == [("calculator", {"expression": "2 + 3"}), ("g", {"x": 1})]
    v11 = parse('[TOOL_CALLS]calculator[ARGS]{"expression": "2 + 3"}[TOOL_CALLS]g[CALL_ID]a1b2c3d4e[ARGS]{}</s>')
    # Mistral's templates refuse ids that are not 9 letters or digits: the model's own, else call00000, ...
    assert [(c.name, c.arguments, c.call_id) for c in v11.calls] == [
        ("calculator", {"expression": "2 + 3"}, "call00000"), ("g", {}, "a1b2c3d4e")]
    assert [c.call_id for c in v3.calls] == ["call00000", "call00001"]
    own = parse('[TOOL_CALLS] [{"name": "f", "arguments": {}, "id": "Ab3dE6gH9"}, {"name": "f", "arguments": {}, '
                '"id": "call_1"}]</s>')
    assert [c.call_id for c in own.calls] == ["Ab3dE6gH9", "call00001"]
    assert parse("5</s>") == ParsedTurn("5")
    assert "without a call" in parse("[TOOL_CALLS]").errors[0].message
    bad_args = parse("[TOOL_CALLS]f[ARGS]{bad")
    assert bad_args.errors[0].name == "f" and "malformed tool call JSON" in bad_args.errors[0].message
    assert "must be a JSON object with a name, got int" in parse("[TOOL_CALLS][1]").errors[0].message


SCHEMAS = [{"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
    "room": {"type": "string"}, "nights": {"type": "integer"}, "price": {"type": "number"},
    "breakfast": {"type": "boolean"}, "guests": {"type": "array"}, "extras": {"type": ["object", "null"]}}}}}]


def test_qwen3_xml_calls_read_each_value_as_its_schemas_type():
    fmt = Qwen3XmlFormat().with_tools(SCHEMAS)
    turn = fmt.parse("<think>\nBook it.\n</think>\n\nBooking." + qwen3_xml_call(
        "book", room="007", nights="3", price="99.5", breakfast="True", guests='["ann", "bo"]',
        extras='{"crib": true}') + qwen3_xml_call("other", n="2", text="two\nlines") + "<|im_end|>")
    assert (turn.reasoning, turn.content) == ("Book it.", "Booking.")
    assert [(c.name, c.arguments, c.call_id) for c in turn.calls] == [
        ("book", {"room": "007", "nights": 3, "price": 99.5, "breakfast": True, "guests": ["ann", "bo"],
                  "extras": {"crib": True}}, "call_0"),
        ("other", {"n": 2, "text": "two\nlines"}, "call_1")]   # no schema: what the JSON says, else the text
    # a value that is not its declared type stays text (the tool's own check refuses it)
    assert fmt.parse(qwen3_xml_call("book", nights="three")).calls[0].arguments == {"nights": "three"}
    # without the schemas every value that reads as JSON is JSON
    assert Qwen3XmlFormat().parse(qwen3_xml_call("book", room="12")).calls[0].arguments == {"room": 12}
    for text, message in (("<tool_call>\n{\"name\": \"book\"}\n</tool_call>", "must start with <function=NAME>"),
                          ("<tool_call><function=book><parameter=room>1</tool_call>", "unterminated <parameter"),
                          ("<tool_call><function=book>junk<parameter=room>1</parameter></function></tool_call>",
                           "unexpected text"),
                          (qwen3_xml_call("book", room="a").replace("</function>",
                                                          "<parameter=room>\nb\n</parameter>\n</function>"),
                           "given twice"),
                          ("<tool_call><function=book", "unterminated tool call")):
        assert message in fmt.parse(text).errors[0].message, text


def test_parsing_hostile_turns_never_raises_and_stays_linear():
    texts = ['{"name":"f","parameters":{}};' * 20000, "[TOOL_CALLS]" * 50000, "[TOOL_CALLS]" + "[" * 100000,
             "{" * 100000, "[TOOL_CALLS]f[ARGS]" + '{"a":' * 5000, '{"name": "f", "parameters": {"n": ' + "9" * 5000 + "}}",
             "<|python_tag|>" * 1000, "[TOOL_CALLS]" + '{"name": "f", "arguments": {}}' * 20000]
    texts += ["<tool_call><function=f>" + "<parameter=a>" * 20000 + "</tool_call>",
              "<tool_call><function=f>" + "<parameter=a>1</parameter>" * 20000 + "</function></tool_call>",
              "<tool_call>" * 20000, "<tool_call><function=f><parameter=a>" + "[" * 100000 + "</parameter></tool_call>"]
    for fmt in (Llama3JsonFormat(), Llama4JsonFormat(), MistralFormat(), Qwen3XmlFormat().with_tools(SCHEMAS)):
        for text in texts:
            start = time.perf_counter()
            turn = fmt.parse(text)
            assert time.perf_counter() - start < 10, (fmt, len(text))   # measured: well under 1 s
            assert isinstance(turn, ParsedTurn)


# ----------------------------------------------------------------------------- the format of a template

def test_the_format_is_read_from_the_chat_template(llama_dir, harmony_dir, tok_dir, tmp_path):
    qwen = build_qwen3_style_tokenizer(tmp_path)
    assert infer_format(load_tokenizer(llama_dir).chat_template_source) == "llama3_json"
    assert infer_format(load_tokenizer(harmony_dir).chat_template_source) == "harmony"
    assert infer_format(load_tokenizer(qwen).chat_template_source) == "qwen3"
    assert infer_format(load_tokenizer(tok_dir).chat_template_source) == "compact"
    assert infer_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert infer_format("{{ '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert infer_format("{{- '<tool_call>\\n<function=' + tc.name + '>\\n' }}") == "qwen3_xml"
    assert infer_format(None) is None


def test_a_format_value_is_used_as_given_and_checked():
    class Shouting:
        name = "shouting"

        def parse(self, text):
            return ParsedTurn(text.upper())

    fmt = Shouting()
    assert get_format(fmt) is fmt and AgentConfig(tool_format=fmt).tool_format is fmt
    assert get_format("llama3_json") == Llama3JsonFormat() and repr(MistralFormat()) == "MistralFormat()"
    with pytest.raises(TypeError, match="parse"):
        AgentConfig(tool_format=42)
    with pytest.raises(ValueError, match="unknown tool-call format 'llama'.*llama3_json"):
        AgentConfig(tool_format="llama")


# ----------------------------------------------------------------------------- pythonic calls (Llama 3.2 / 4)

def test_pythonic_calls_are_read_as_literals_never_evaluated():
    parse = PythonicFormat().parse
    one = parse('[calculator(expression="2 + 3")]<|eot_id|>')
    assert one == ParsedTurn("", (ToolCall("calculator", {"expression": "2 + 3"}, "call_0",
                                           raw='calculator(expression="2 + 3")'),))
    many = parse('<|python_start|>[get_weather(city="Paris", days=3), functions.add(a=-1, b=2.5, '
                 'flags=[true, None, (1, 2)], opts={"x": False})]<|python_end|><|eom|>')
    assert [(c.name, c.arguments, c.call_id) for c in many.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3}, "call_0"),
        ("functions.add", {"a": -1, "b": 2.5, "flags": [True, None, [1, 2]], "opts": {"x": False}}, "call_1")]
    # Llama 4's template writes the content, then the list: text before a list that ends the turn
    after_text = parse('Let me compute that.[calculator(expression="2+3")]<|eot|>')
    assert after_text.content == "Let me compute that." and after_text.tool_calls[0].arguments == {"expression": "2+3"}
    # prose that mentions a call is prose
    for prose in ("The list [f(x)] is not a call.", "Use [f(a=1)] and say hi", "<answer>5</answer>"):
        assert parse(prose + "<|eot|>") == ParsedTurn(prose)
    # each bad call is its own error, in place; the good ones still run
    mixed = parse('[f(1, a=2), g(**k), h(a=__import__("os").system("ls")), k(a={1: 2}), ok(a=1)]')
    assert [getattr(c, "name", None) for c in mixed.calls] == ["f", "g", "h", "k", "ok"]
    assert [type(c).__name__ for c in mixed.calls] == ["ToolCallError"] * 4 + ["ToolCall"]
    assert "positional" in mixed.calls[0].message and "**" in mixed.calls[1].message
    assert "call where a literal value belongs" in mixed.calls[2].message and "string" in mixed.calls[3].message
    # a turn that starts a call list and does not parse is one error observation
    for broken, why in (('[calculator(expression="2 + 3"', "must end with its closing ]"),
                        ('[calculator(expression="2 +)]', "malformed pythonic tool call list"),
                        ("[f(a=1)] and more", "must end with its closing ]"),
                        ("[f(a=" + "[" * 5000 + "]", "too many nested")):
        turn = parse(broken)
        assert turn.content == "" and why in turn.errors[0].message, broken
    # a "\\d" escape is a SyntaxWarning to Python (an error under -W error): the value still stands
    assert parse('[grep(pattern="\\d+")]').tool_calls[0].arguments == {"pattern": "\\d+"}
    assert infer_format(LLAMA4_PYTHONIC_STYLE_TEMPLATE) == "pythonic" and get_format("pythonic") == PythonicFormat()


def test_pythonic_parsing_of_hostile_turns_never_raises():
    texts = ["[f(a=1), " * 20000 + "]", "[" * 100000, "[f(" * 50000, "[f(a=" + "[" * 100000 + "]",
             "[f(a=1)]" * 20000, "x [f(a=1)]" * 20000 + "]", "[f(a='" + "\\" * 100000 + "')]",
             "[f(a=" + "9" * 5000 + ")]", "[f(" + ", ".join(f"a{i}={i}" for i in range(20000)) + ")]",
             "[" + "a." * 3000 + "f(x=1)]", "[" + "a." * 50000 + "f(x=1)]"]   # a dotted name thousands deep
    for text in texts:
        start = time.perf_counter()
        turn = PythonicFormat().parse(text)
        assert time.perf_counter() - start < 10, len(text)   # measured: under 0.5 s
        assert isinstance(turn, ParsedTurn)


# ----------------------------------------------------------------------------- Llama 4 JSON calls

def test_llama4_json_calls_end_on_llama4_tokens_and_may_be_several():
    parse = Llama4JsonFormat().parse
    one = parse('{"name": "calculator", "parameters": {"expression": "2 + 3"}}<|eot|>')
    assert [(type(c).__name__, c.name, c.arguments) for c in one.calls] == [("ToolCall", "calculator",
                                                                             {"expression": "2 + 3"})]
    two = parse('<|python_start|>{"name": "f", "parameters": {}}{"name": "g", "parameters": {"x": 1}}'
                '<|python_end|><|eom|>')
    assert [(c.name, c.arguments, c.call_id) for c in two.calls] == [("f", {}, "call_0"), ("g", {"x": 1}, "call_1")]
    assert parse("<answer>5</answer><|eot|>") == ParsedTurn("<answer>5</answer>")
    assert "<|python_start|> without a JSON tool call" in parse("<|python_start|>hi<|eom|>").errors[0].message
    assert infer_format(LLAMA4_JSON_STYLE_TEMPLATE) == "llama4_json" and get_format("llama4_json") == Llama4JsonFormat()
    assert Llama4JsonFormat() != Llama3JsonFormat()


# ----------------------------------------------------------------------------- Granite 3

def test_granite_calls_as_a_list_or_one_object_after_each_tag():
    parse = GraniteFormat().parse
    listed = parse('<|tool_call|>[{"name": "calculator", "arguments": {"expression": "2 + 3"}}, '
                   '{"name": "f", "arguments": {}}]<|end_of_text|>')
    assert [(c.name, c.arguments, c.call_id) for c in listed.calls] == [
        ("calculator", {"expression": "2 + 3"}, "call_0"), ("f", {}, "call_1")]
    tagged = parse('Computing.<|tool_call|> {"name": "f", "arguments": {"x": 1}}\n'
                   '<|tool_call|> {"name": "g", "arguments": {}}\n<|end_of_text|>')
    assert tagged.content == "Computing." and [(c.name, c.arguments) for c in tagged.calls] == [("f", {"x": 1}),
                                                                                            ("g", {})]
    assert parse("<answer>5</answer><|end_of_text|>") == ParsedTurn("<answer>5</answer>")
    errors = [parse(t).calls for t in ("<|tool_call|>", "<|tool_call|>[]", '<|tool_call|>[{"name": 3}]',
                                       '<|tool_call|>{"name": "f", "arguments": {')]
    assert [[type(c).__name__ for c in calls] for calls in errors] == [["ToolCallError"]] * 4
    # text after a call is an error of its own, the call stays
    trailing = parse('<|tool_call|>{"name": "f", "arguments": {}} and more')
    assert [type(c).__name__ for c in trailing.calls] == ["ToolCall", "ToolCallError"]
    for text in ("<|tool_call|>" * 50000, "<|tool_call|>[" + "[" * 100000, "<|tool_call|>" + '{"name": "f"}' * 30000):
        start = time.perf_counter()
        assert isinstance(parse(text), ParsedTurn) and time.perf_counter() - start < 10


def test_granite_tool_loop_and_sft_over_a_granite_style_template(tmp_path):
    from sfrrl_jax.agents import calculator_demonstration, calculator_tool_schemas
    from sfrrl_jax.agents.tasks.demos import render_sft_example
    from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
    from family_tokenizer_fixtures import GRANITE_STYLE_TEMPLATE, build_granite_style_tokenizer

    tok = load_tokenizer(build_granite_style_tokenizer(tmp_path))
    assert infer_format(tok.chat_template_source) == infer_format(GRANITE_STYLE_TEMPLATE) == "granite"
    observation = _calculator_loop(tok, [
        '<|tool_call|>[{"name": "calculator", "arguments": {"expression": "2 + 3"}}]<|end_of_text|>',
        "<answer>5</answer><|end_of_text|>"])
    assert observation == "\n<|start_of_role|>tool_response<|end_of_role|>5<|end_of_text|>\n" \
                          "<|start_of_role|>assistant<|end_of_role|>"
    tokens, mask = render_sft_example(tok, calculator_demonstration(arithmetic_task("2 + 3 - 1", "t")),
                                      calculator_tool_schemas())
    learned = tok.decode([t for t, m in zip(tokens, mask) if m])
    assert '<|tool_call|> {"name": "calculator", "arguments": {"expression": "5 - 1"}}' in learned


# ----------------------------------------------------------------------------- OLMo 3

def test_olmo3_calls_one_a_line_inside_function_calls():
    parse = Olmo3Format().parse
    turn = parse('Let me look.<function_calls>calculator(expression="2 + 3")\n'
                 'search(query="caf\u00e9 \\"x\\"", exact=true, limit=null, opts={"tags": ["a", "b"], "n": -1.5})'
                 '</function_calls><|im_end|>')
    assert turn.content == "Let me look."
    assert [(c.name, c.arguments, c.call_id) for c in turn.calls] == [
        ("calculator", {"expression": "2 + 3"}, "call_0"),
        ("search", {"query": 'caf\u00e9 "x"', "exact": True, "limit": None, "opts": {"tags": ["a", "b"], "n": -1.5}},
         "call_1")]
    # Python literals and a Llama-style list inside the tags read the same; a <think> block is reasoning
    def named(turn):
        return [(c.name, c.arguments, c.call_id) for c in turn.calls]
    assert named(parse("<function_calls>[f(a=True, b='x'), g()]</function_calls>")) == named(parse(
        '<function_calls>f(a=true, b="x")\ng()</function_calls>')) == [("f", {"a": True, "b": "x"}, "call_0"),
                                                                         ("g", {}, "call_1")]
    thought = parse("<think>use <function_calls> later</think><answer>5</answer><|endoftext|>")
    assert thought == ParsedTurn("<answer>5</answer>", reasoning="use <function_calls> later")
    # a close tag inside a string argument does not end the block
    inside = parse('<function_calls>echo(text="</function_calls>")</function_calls>')
    assert [(c.name, c.arguments) for c in inside.calls] == [("echo", {"text": "</function_calls>"})]
    # two blocks: their calls numbered on; a bad call is an error in its place, the others stand
    two = parse("<function_calls>f(a=1)</function_calls> and <function_calls>g(b=2)\nh(3)</function_calls>")
    assert two.content == "and" and [type(c).__name__ for c in two.calls] == ["ToolCall", "ToolCall", "ToolCallError"]
    assert [c.call_id for c in two.tool_calls] == ["call_0", "call_1"]
    assert "positional arguments" in two.errors[0].message
    for text, why in (("<function_calls>f(a=1", "unterminated"),
                      ("<function_calls></function_calls>", "without a call"),
                      ("<function_calls>import os</function_calls>", "one name(key=value, ...) a line"),
                      ("<function_calls>f(a=__import__('os'))</function_calls>", "literal value"),
                      ("<function_calls>f(a=1)) + (</function_calls>", "malformed")):
        calls = parse(text).calls
        assert len(calls) == 1 and why in calls[0].message, (text, calls)
    assert infer_format("{{ '<function_calls>' }}") == "olmo3" and get_format("olmo3") == Olmo3Format()
    for text in ("<function_calls>" * 50000, "<function_calls>f(" + "</function_calls>" * 50000,
                 "<function_calls>f(a=" + "[" * 100000 + "</function_calls>",
                 ("<function_calls>f(" + "x" * 1000 + "</function_calls>") * 2000,
                 "<function_calls>f(a=1)</function_calls>" * 5000):
        start = time.perf_counter()
        assert isinstance(parse(text), ParsedTurn) and time.perf_counter() - start < 10


def test_olmo3_tool_loop_and_sft_over_an_olmo3_style_template(tmp_path):
    from sfrrl_jax.agents import calculator_demonstration, calculator_tool_schemas
    from sfrrl_jax.agents.tasks.demos import render_sft_example
    from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
    from sfrrl_jax.launch.agentic import FAMILY_FORMATS
    from family_tokenizer_fixtures import OLMO3_STYLE_TEMPLATE, build_olmo3_style_tokenizer

    tok = load_tokenizer(build_olmo3_style_tokenizer(tmp_path))
    assert infer_format(tok.chat_template_source) == infer_format(OLMO3_STYLE_TEMPLATE) == FAMILY_FORMATS["olmo3"]
    im_end, eos = _ids(tok, "<|im_end|>", "<|endoftext|>")
    assert set(turn_stop_ids(Olmo3Format(), tok)) == {im_end, eos}
    observation = _calculator_loop(tok, ['<function_calls>calculator(expression="2 + 3")</function_calls><|im_end|>',
                                         "<answer>5</answer><|endoftext|>"])
    assert observation == "\n<|im_start|>environment\n5<|im_end|>\n<|im_start|>assistant\n"
    tokens, mask = render_sft_example(tok, calculator_demonstration(arithmetic_task("2 + 3 - 1", "t")),
                                      calculator_tool_schemas())
    learned = tok.decode([t for t, m in zip(tokens, mask) if m])
    # a call is learned closed as the template closes a past turn (<|im_end|>), the last answer
    # with eos: the example is the template's render of the whole transcript
    assert '<function_calls>calculator(expression="5 - 1")</function_calls><|im_end|>' in learned
    assert learned.endswith("<answer>4</answer><|endoftext|>")
    demo = calculator_demonstration(arithmetic_task("2 + 3 - 1", "t"))
    assert tokens == tok.apply_chat_template(demo, calculator_tool_schemas())


# ----------------------------------------------------------------------------- DeepSeek V3 / R1 / V3.1

_CB, _CE, _SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_BLOCK, _BLOCK_END, _EOS = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜end▁of▁sentence｜>"


def _ds_v3(name, arguments):
    return f"{_CB}function{_SEP}{name}\n```json\n{arguments}\n```{_CE}"


def _ds_v31(name, arguments):
    return f"{_CB}{name}{_SEP}{arguments}{_CE}"


def test_deepseek_calls_in_the_v3_and_v31_layouts():
    parse = DeepSeekFormat().parse
    v3 = parse("Let me compute." + _BLOCK + _ds_v3("calculator", '{"expression": "2 + 3"}') + "\n"
               + _ds_v3("f", "{}") + _BLOCK_END + _EOS)
    assert v3.content == "Let me compute." and [(c.name, c.arguments, c.call_id) for c in v3.calls] == [
        ("calculator", {"expression": "2 + 3"}, "call_0"), ("f", {}, "call_1")]
    v31 = parse("<think>use the tool</think>" + _BLOCK + _ds_v31("calculator", '{"expression": "2 + 3"}')
                + _BLOCK_END + _EOS)
    assert v31.reasoning == "use the tool" and [(c.name, c.arguments) for c in v31.calls] == [
        ("calculator", {"expression": "2 + 3"})]
    assert parse("<answer>5</answer>" + _EOS) == ParsedTurn("<answer>5</answer>")
    # a bad call is an error in its place, the good ones stand
    mixed = parse(_BLOCK + _ds_v3("f", '{"a": 1') + _ds_v31("g", '{"b": 2}') + _BLOCK_END)
    assert [type(c).__name__ for c in mixed.calls] == ["ToolCallError", "ToolCall"] and mixed.calls[0].name == "f"
    for text, why in ((_BLOCK + _BLOCK_END, "without a call"), (_BLOCK + _CB + "f" + _SEP + "{}", "unterminated"),
                      (_BLOCK + _CB + "f {}" + _CE + _BLOCK_END, f"without {_SEP}"),
                      (_BLOCK + _CB + "tool" + _SEP + "f\n```json\n{}\n```" + _CE + _BLOCK_END, "not 'function'"),
                      (_BLOCK + _ds_v31("f", "[1]") + _BLOCK_END, "must be a JSON object"),
                      (_BLOCK + _ds_v31("f", "{}") + _BLOCK_END + "more", "unexpected text after")):
        assert any(why in e.message for e in parse(text).errors), (text, parse(text))
    assert infer_format("{{ '<｜tool▁calls▁begin｜>' }}") == "deepseek_v3"
    assert get_format("deepseek_v3") == DeepSeekFormat()
    for text in (_BLOCK + _CB * 50000, _BLOCK + _ds_v31("f", "{") * 30000, _BLOCK + _CB + "function" + _SEP
                 + "f\n```json\n" + "```  " * 30000 + "x" + _CE, _BLOCK + _ds_v31("f", "[" * 100000)):
        start = time.perf_counter()
        assert isinstance(parse(text), ParsedTurn) and time.perf_counter() - start < 10


def test_deepseek_tool_loop_and_sft_over_a_deepseek_style_template(tmp_path):
    from sfrrl_jax.agents import calculator_demonstration, calculator_tool_schemas
    from sfrrl_jax.agents.tasks.demos import render_sft_example
    from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
    from family_tokenizer_fixtures import DEEPSEEK_STYLE_TEMPLATE, build_deepseek_style_tokenizer

    tok = load_tokenizer(build_deepseek_style_tokenizer(tmp_path))
    assert infer_format(tok.chat_template_source) == infer_format(DEEPSEEK_STYLE_TEMPLATE) == "deepseek_v3"
    observation = _calculator_loop(tok, [_BLOCK + _ds_v3("calculator", '{"expression": "2 + 3"}') + _BLOCK_END + _EOS,
                                         "<answer>5</answer>" + _EOS])
    # the results, and no generation prompt after them: the model goes on where they end
    assert observation == "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>5<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    demo = calculator_demonstration(arithmetic_task("2 + 3 - 1", "t"))
    tokens, mask = render_sft_example(tok, demo, calculator_tool_schemas())
    learned = tok.decode([t for t, m in zip(tokens, mask) if m])
    assert _BLOCK + _ds_v3("calculator", '{"expression": "5 - 1"}') + _BLOCK_END + _EOS in learned
    assert learned.endswith("<answer>4</answer>" + _EOS)
    assert tokens == tok.apply_chat_template(demo, calculator_tool_schemas())


# ----------------------------------------------------------------------------- GLM-4.5

_CALC = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {
    "expression": {"type": "string"}, "digits": {"type": "integer"}, "exact": {"type": "boolean"},
    "tags": {"type": "array"}}}}}]


def test_glm45_calls_as_arg_key_value_pairs_read_by_their_schemas():
    parse = Glm45Format().with_tools(_CALC).parse
    turn = parse("\n<think>use the tool</think>\nLet me compute.\n<tool_call>calc\n<arg_key>expression</arg_key>\n"
                 "<arg_value>2 + 3</arg_value>\n<arg_key>digits</arg_key>\n<arg_value>4</arg_value>\n"
                 "<arg_key>exact</arg_key>\n<arg_value>true</arg_value>\n<arg_key>tags</arg_key>\n"
                 '<arg_value>["a", 1]</arg_value>\n</tool_call>\n<tool_call>calc\n<arg_key>expression</arg_key>\n'
                 "<arg_value>42</arg_value>\n</tool_call><|observation|>")
    assert (turn.reasoning, turn.content) == ("use the tool", "Let me compute.")
    assert [(c.name, c.arguments, c.call_id) for c in turn.calls] == [
        ("calc", {"expression": "2 + 3", "digits": 4, "exact": True, "tags": ["a", 1]}, "call_0"),
        ("calc", {"expression": "42"}, "call_1")]   # a string by its schema, though it reads as JSON
    assert Glm45Format().parse("<tool_call>calc\n<arg_key>expression</arg_key>\n<arg_value>42</arg_value>\n"
                               "</tool_call>").calls[0].arguments == {"expression": 42}   # no schema: as JSON
    assert parse("\n<think></think>\n<answer>5</answer><|user|>") == ParsedTurn("<answer>5</answer>")
    for text, why in (("<tool_call>calc\n<arg_key>expression</arg_key>\n</tool_call>", "without its <arg_value>"),
                      ("<tool_call>calc\nexpression=1</tool_call>", "no valid tool name"),
                      ("<tool_call>calc\n<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key>"
                       "<arg_value>2</arg_value></tool_call>", "given twice"),
                      ("<tool_call>calc\n<arg_key>a</arg_key><arg_value>1</arg_value>", "unterminated")):
        assert any(why in e.message for e in parse(text).errors), (text, parse(text))
    assert infer_format("{{ '<tool_call>' + name + '<arg_key>' }}") == "glm45" and get_format("glm45") == Glm45Format()
    for text in ("<tool_call>" * 50000, "<tool_call>f" + "<arg_key>k</arg_key>" * 30000 + "</tool_call>",
                 "<tool_call>f" + "<arg_key>k</arg_key><arg_value>1</arg_value>" * 20000 + "</tool_call>"):
        start = time.perf_counter()
        assert isinstance(parse(text), ParsedTurn) and time.perf_counter() - start < 10


def test_glm45_loop_and_sft_where_each_turn_ends_with_the_next_messages_opener(tmp_path):
    """GLM-4.5's template closes no turn: the model ends a call with <|observation|> and an answer
    with <|user|>, the tokens that open the next message. The observation delta starts after the
    generated opener, and SFT learns each turn with the opener the template writes after it."""
    from sfrrl_jax.agents import calculator_demonstration, calculator_tool_schemas
    from sfrrl_jax.agents.tasks.demos import render_sft_example
    from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
    from sfrrl_jax.launch.agentic import FAMILY_FORMATS
    from family_tokenizer_fixtures import GLM45_STYLE_TEMPLATE, build_glm45_style_tokenizer

    tok = load_tokenizer(build_glm45_style_tokenizer(tmp_path))
    assert infer_format(tok.chat_template_source) == infer_format(GLM45_STYLE_TEMPLATE) == FAMILY_FORMATS["glm4_moe"]
    assert set(turn_stop_ids(Glm45Format(), tok)) == set(_ids(tok, "<|endoftext|>", "<|user|>", "<|observation|>"))
    observation = _calculator_loop(tok, [
        "\n<think>use it</think>\n<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>2 + 3</arg_value>\n"
        "</tool_call><|observation|>", "\n<think></think>\n<answer>5</answer><|user|>"])
    assert observation == "\n<tool_response>\n5\n</tool_response><|assistant|>"
    # a call ended with another stop (<|user|>): the delta brings the opener the template writes
    observation = _calculator_loop(tok, [
        "\n<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>2 + 3</arg_value>\n</tool_call><|user|>",
        "\n<answer>5</answer><|user|>"])
    assert observation == "<|observation|>\n<tool_response>\n5\n</tool_response><|assistant|>"
    demo = calculator_demonstration(arithmetic_task("2 + 3 - 1", "t"))
    tokens, mask = render_sft_example(tok, demo, calculator_tool_schemas())
    learned = tok.decode([t for t, m in zip(tokens, mask) if m])
    assert ("<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>5 - 1</arg_value>\n</tool_call>"
            "<|observation|>") in learned
    assert learned.endswith("<answer>4</answer><|user|>")
    # the template's render of the transcript, plus the opener the last answer is learned with
    assert tokens == tok.apply_chat_template(demo, calculator_tool_schemas()) + _ids(tok, "<|user|>")



def test_smollm3_template_gets_its_tools_and_the_turns_as_generated(tmp_path):
    """SmolLM3's template reads the tools from `xml_tools` (HF's `tools` it ignores) and renders an
    assistant message's content alone, never its tool_calls. The tools reach the prompt; the loop
    keeps a call turn's text (reasoning and calls) as its content, so the template's render of the
    trajectory's messages is the trajectory, and SFT on them learns the turns as generated. SFT on
    messages whose calls are only in tool_calls is refused, saying why."""
    import asyncio

    from sfrrl_jax.agents import calculator_demonstration, calculator_environment, calculator_tool_schemas, run_agent
    from sfrrl_jax.agents.tasks.demos import render_sft_example
    from sfrrl_jax.agents.formats.registry import renders_tool_calls
    from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
    from sfrrl_jax.testing.scripted_engine import ScriptedEngine
    from family_tokenizer_fixtures import build_smollm3_style_tokenizer

    tok = load_tokenizer(build_smollm3_style_tokenizer(tmp_path))
    schemas = calculator_tool_schemas()
    assert infer_format(tok.chat_template_source) == "qwen3" and not renders_tool_calls(tok)
    from types import SimpleNamespace as Tok   # read in code (an attribute, a key), not in the text
    assert [renders_tool_calls(Tok(chat_template_source=t)) for t in (
        "no tool_calls here{{ m.content }}", "{{ m.tool_calls }}", "{% if 'tool_calls' in m %}x{% endif %}")] == [
        False, True, True]
    hello = [{"role": "user", "content": "hi"}]
    assert "### Tools" in tok.render(hello, schemas) and "'name': 'calculator'" in tok.render(hello, schemas)
    assert "### Tools" not in tok.with_template_kwargs(xml_tools=None).render(hello, schemas)   # a given one wins
    call = ('<think>\nuse it\n</think>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n'
            '</tool_call><|im_end|>')
    env = calculator_environment()
    try:
        traj = asyncio.run(run_agent(ScriptedEngine([call, "<think>\nok\n</think>\n<answer>5</answer><|im_end|>"],
                                                    tokenizer=tok), env, arithmetic_task("2 + 3", "t0"), tok,
                                     AgentConfig(max_turns=3, max_new_tokens_per_turn=96, max_total_tokens=2048)))
    finally:
        env.close()
    assert (traj.error, traj.finish_reason, traj.reward) == (None, "answer", 1.0)
    turn = next(m for m in traj.messages if m["role"] == "assistant")
    assert turn["content"] == call.removesuffix("<|im_end|>")
    assert turn["tool_calls"][0]["function"]["name"] == "calculator"
    rendered = tok.apply_chat_template(traj.messages, schemas)
    assert rendered[:len(traj.tokens)] == list(traj.tokens) and tok.decode(rendered[len(traj.tokens):]) == "\n"
    tokens, mask = render_sft_example(tok, traj.messages, schemas)
    assert tokens == list(traj.tokens)
    assert tok.decode([t for t, m in zip(tokens, mask) if m]).startswith(call)
    with pytest.raises(ValueError, match="renders an assistant message's content only, not its tool_calls"):
        render_sft_example(tok, calculator_demonstration(arithmetic_task("2 + 3", "t")), schemas)
