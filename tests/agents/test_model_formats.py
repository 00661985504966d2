"""Tool-call formats of the model families (Llama 3 JSON, Llama 3.2 / 4 pythonic, Mistral, gpt-oss
harmony) end to end:
the turn's stop tokens (generation_config.json's, refined by the format), the parse, the format
read from the chat template, and a multi-turn tool loop over each family's template."""
import asyncio
import dataclasses
import sys
import time
from pathlib import Path

import pytest

from sfrrl_jax.agents import (AgentConfig, ParsedTurn, calculator_demonstration, calculator_environment,
                              calculator_tool_schemas, render_sft_example, run_agent)
from sfrrl_jax.agents.formats import (HarmonyFormat, Llama3JsonFormat, Llama4JsonFormat, MistralFormat, PythonicFormat,
                                      Qwen3Format, Qwen3XmlFormat, get_format, infer_format, turn_stop_ids)
from sfrrl_jax.agents.protocols import ToolCall
from sfrrl_jax.agents.tasks import arithmetic_task
from sfrrl_jax.testing.scripted_engine import ScriptedEngine
from sfrrl_jax.tokenizer import TemplateDeltaError, load_tokenizer

from family_tokenizer_fixtures import (LLAMA4_JSON_STYLE_TEMPLATE, LLAMA4_PYTHONIC_STYLE_TEMPLATE,
                                      build_harmony_style_tokenizer,
                                      build_llama3_style_tokenizer, build_llama4_pythonic_style_tokenizer,
                                      build_mistral_style_tokenizer)

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoints"))
from hf_tokenizer_fixtures import QWEN3_STYLE_TEMPLATE, build_qwen3_style_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_llama3_style_tokenizer(tmp_path_factory.mktemp("llama3_style"))


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory):
    return build_harmony_style_tokenizer(tmp_path_factory.mktemp("harmony_style"))


def _ids(tok, *tokens):
    return [tok.token_to_id(t) for t in tokens]


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


def _xml(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_xml_calls_read_each_value_as_its_schemas_type():
    fmt = Qwen3XmlFormat().with_tools(SCHEMAS)
    turn = fmt.parse("<think>\nBook it.\n</think>\n\nBooking." + _xml(
        "book", room="007", nights="3", price="99.5", breakfast="True", guests='["ann", "bo"]',
        extras='{"crib": true}') + _xml("other", n="2", text="two\nlines") + "<|im_end|>")
    assert (turn.reasoning, turn.content) == ("Book it.", "Booking.")
    assert [(c.name, c.arguments, c.call_id) for c in turn.calls] == [
        ("book", {"room": "007", "nights": 3, "price": 99.5, "breakfast": True, "guests": ["ann", "bo"],
                  "extras": {"crib": True}}, "call_0"),
        ("other", {"n": 2, "text": "two\nlines"}, "call_1")]   # no schema: what the JSON says, else the text
    # a value that is not its declared type stays text (the tool's own check refuses it)
    assert fmt.parse(_xml("book", nights="three")).calls[0].arguments == {"nights": "three"}
    # without the schemas every value that reads as JSON is JSON
    assert Qwen3XmlFormat().parse(_xml("book", room="12")).calls[0].arguments == {"room": 12}
    for text, message in (("<tool_call>\n{\"name\": \"book\"}\n</tool_call>", "must start with <function=NAME>"),
                          ("<tool_call><function=book><parameter=room>1</tool_call>", "unterminated <parameter"),
                          ("<tool_call><function=book>junk<parameter=room>1</parameter></function></tool_call>",
                           "unexpected text"),
                          (_xml("book", room="a").replace("</function>",
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


# ----------------------------------------------------------------------------- the loop over each family

CFG = AgentConfig(max_turns=3, max_new_tokens_per_turn=96, max_total_tokens=2048, temperature=0.0)


def _roll(tok, turns, fmt, **config):
    engine = ScriptedEngine(turns, tokenizer=tok)
    env = calculator_environment()
    try:
        traj = asyncio.run(run_agent(engine, env, arithmetic_task("2 + 3", "t0"), tok,
                                     dataclasses.replace(CFG, tool_format=fmt, **config)))
    finally:
        env.close()
    return traj, engine


def test_llama3_tool_loop_stops_on_eom_runs_the_call_and_answers(llama_dir):
    tok = load_tokenizer(llama_dir)
    fmt = infer_format(tok.chat_template_source)
    traj, engine = _roll(tok, ['{"name": "calculator", "parameters": {"expression": "2 + 3"}}<|eom_id|>',
                               "<answer>5</answer><|eot_id|>"], fmt)
    assert (traj.error, traj.finish_reason, traj.reward, len(traj.turns)) == (None, "answer", 1.0, 2)
    assert traj.turns[0].engine_finish_reason == "stop" and traj.turns[0].num_tool_calls == 1
    assert tok.token_to_id("<|eom_id|>") in engine.requests[0].stop_token_ids
    tool = [m for m in traj.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool] == ["5"]
    # the observation appended after the call is the template's ipython turn, then the next prompt
    observation = tok.decode(traj.tokens[traj.turns[0].gen_end:traj.turns[0].obs_end])
    assert observation == ("<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_harmony_tool_loop_reasons_calls_and_answers_on_the_final_channel(harmony_dir):
    tok = load_tokenizer(harmony_dir)
    fmt = infer_format(tok.chat_template_source)
    call = ('<|channel|>analysis<|message|>Add them with the tool.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.calculator <|constrain|>json<|message|>{"expression": "2 + 3"}<|call|>')
    traj, engine = _roll(tok, [call, "<|channel|>final<|message|><answer>5</answer><|return|>"], fmt)
    assert (traj.error, traj.finish_reason, traj.reward, len(traj.turns)) == (None, "answer", 1.0, 2)
    stops = engine.requests[0].stop_token_ids
    assert tok.token_to_id("<|call|>") in stops and tok.token_to_id("<|end|>") not in stops
    assistant = [m for m in traj.messages if m["role"] == "assistant"]
    assert assistant[0]["reasoning_content"] == "Add them with the tool." and assistant[1]["content"] == "<answer>5</answer>"
    observation = tok.decode(traj.tokens[traj.turns[0].gen_end:traj.turns[0].obs_end])
    assert observation == ("<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>5<|end|>"
                           "<|start|>assistant")
    # prompt + the call turn as generated + the observation is the template's own render
    upto = traj.tokens[:traj.turns[0].obs_end]
    assert upto == tok.apply_chat_template(traj.messages[:-1], calculator_environment().tool_schemas(),
                                           add_generation_prompt=True)
    assert traj.metadata["rewards"] == {"answer_correct": 1.0}


def test_qwen3_xml_tool_loop_over_a_qwen_template(tmp_path):
    tok = load_tokenizer(build_qwen3_style_tokenizer(tmp_path))
    traj, _ = _roll(tok, [_xml("calculator", expression="2 + 3") + "<|im_end|>", "<answer>5</answer><|im_end|>"],
                    "qwen3_xml")
    assert (traj.error, traj.finish_reason, traj.reward, len(traj.turns)) == (None, "answer", 1.0, 2)
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["5"]


def test_qwen3_call_turns_without_reasoning_under_a_template_that_thinks_in_the_last_turn_only(tmp_path):
    """As Qwen3's own template, this one writes a <think> block into an assistant turn that is the
    last message or has reasoning: a call turn without reasoning renders otherwise once its
    result follows. The loop goes on (the delta is what follows the turn's close), with the
    model's own tokens kept; a turn with reasoning renders alike either way."""
    call_turn = "<|im_start|>assistant\n{% if m.content %}"
    assert call_turn in QWEN3_STYLE_TEMPLATE
    template = QWEN3_STYLE_TEMPLATE.replace(call_turn, "<|im_start|>assistant\n{% if loop.last or m.reasoning_content %}"
                                            "<think>\n{{ m.reasoning_content or '' }}\n</think>\n\n{% endif %}"
                                            "{% if m.content %}")
    tok = load_tokenizer(build_qwen3_style_tokenizer(tmp_path, template))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call><|im_end|>'
    traj, _ = _roll(tok, [call, "<think>\nadd\n</think>\n\n" + call.replace("2 + 3", "1 + 4"),
                          "<answer>5</answer><|im_end|>"], "qwen3")
    assert (traj.error, traj.finish_reason, traj.reward, len(traj.turns)) == (None, "answer", 1.0, 3)
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["5", "5"]
    generated = tok.decode(traj.tokens[traj.turns[0].gen_start:traj.turns[0].gen_end])
    observation = tok.decode(traj.tokens[traj.turns[0].gen_end:traj.turns[0].obs_end])
    assert generated == call and observation == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                                                 "<|im_start|>assistant\n")


# ----------------------------------------------------------------------------- a turn's close that changes

HARMONY_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}]}


def test_a_next_user_turn_after_a_harmony_answer_appends_only_the_new_messages(harmony_dir):
    """gpt-oss's template ends the last answer with <|return|> (the model's stop) and an earlier
    one with <|end|>, so the history is not append-only at that token; the delta after the
    generated <|return|> starts after the template's own close."""
    tok = load_tokenizer(harmony_dir)
    history = [{"role": "user", "content": "What is 2 + 3?"},
               {"role": "assistant", "content": "<answer>5</answer>"}]
    assert tok.render(history).endswith("<answer>5</answer><|return|>")
    delta = tok.render_delta(history, [{"role": "user", "content": "And 2 + 4?"}], stop_text="<|return|>")
    assert tok.decode(delta) == "<|start|>user<|message|>And 2 + 4?<|end|><|start|>assistant"
    # a template that renders the history before the turn otherwise: the delta is still only
    # what follows the turn's close (the trajectory keeps what the model saw)
    class Rewriting(type(tok)):
        def render(self, messages, *args, **kwargs):   # another question once the answer is followed
            if len(messages) > 2:
                messages = [{"role": "user", "content": "What is 2 + 4?"}, *messages[1:]]
            return super().render(messages, *args, **kwargs)

    rewriting = Rewriting(tok.hf, tok.config, tok.chat_template_source, generation_eos_ids=tok.generation_eos_ids)
    delta = rewriting.render_delta(history, [{"role": "user", "content": "x"}], stop_text="<|return|>")
    assert tok.decode(delta) == "<|start|>user<|message|>x<|end|><|start|>assistant"


def test_sft_demonstrations_of_harmony_end_their_answer_with_return_and_their_call_with_call(harmony_dir):
    tok = load_tokenizer(harmony_dir)
    tools = calculator_environment().tool_schemas()
    demo = [{"role": "user", "content": "What is 2 + 3?"}, HARMONY_CALL,
            {"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": "5"},
            {"role": "assistant", "content": "<answer>5</answer>"}]
    tokens, mask = render_sft_example(tok, demo, tools)
    assert tokens == tok.apply_chat_template(demo, tools)   # the template's own render, token for token
    learned = [tok.decode([t for t, m in zip(tokens, mask) if m])]
    assert learned[0].endswith("<|constrain|>json<|message|>{\"expression\": \"2 + 3\"}<|call|>"
                               "<|channel|>final<|message|><answer>5</answer><|return|>")
    # a user who speaks again: each answer is learned with the stop the model generates
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "<answer>5</answer>"},
            {"role": "user", "content": "And 2 + 4?"}, {"role": "assistant", "content": "<answer>6</answer>"}]
    tokens, mask = render_sft_example(tok, chat)
    spans, current = [], []
    for t, m in zip(tokens, mask):
        if m:
            current.append(t)
        elif current:
            spans, current = spans + [current], []
    spans.append(current)
    assert [tok.decode(s) for s in spans] == ["<|channel|>final<|message|><answer>5</answer><|return|>",
                                               "<|channel|>final<|message|><answer>6</answer><|return|>"]
    assert "<|start|>user<|message|>And 2 + 4?<|end|><|start|>assistant" in tok.decode(tokens)


def test_an_unparsed_harmony_call_is_an_error_the_model_reads_even_where_the_template_refuses_it(harmony_dir):
    """A call whose JSON does not parse is not in the assistant message; gpt-oss's template
    refuses a tool message that follows no call, so its error goes to the model as a user message
    (its text untrusted) and the trajectory goes on."""
    tok = load_tokenizer(harmony_dir)
    bad = ('<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": 2 +<|call|>')
    good = ('<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "2 + 3"}<|call|>')
    traj, _ = _roll(tok, [bad, good, "<|channel|>final<|message|><answer>5</answer><|return|>"], "harmony")
    assert (traj.error, traj.finish_reason, traj.reward, len(traj.turns)) == (None, "answer", 1.0, 3)
    assert traj.turns[0].num_tool_errors == 1
    observation = tok.decode(traj.tokens[traj.turns[0].gen_end:traj.turns[0].obs_end])
    assert observation.startswith("<|start|>user<|message|>error: malformed tool call JSON")
    assert observation.endswith("<|end|><|start|>assistant")
    assert [m["role"] for m in traj.messages][-5:] == ["assistant", "user", "assistant", "tool", "assistant"]


def test_a_delta_never_cuts_before_the_turn_it_follows(tmp_path):
    """A template that writes no close for an assistant turn: the last close in the history is the
    user's, and cutting there would append the assistant turn a second time; refused instead."""
    from sfrrl_jax.tokenizer import Tokenizer
    base = load_tokenizer(build_qwen3_style_tokenizer(tmp_path))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "{% if m.role != 'assistant' %}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    open_ended = Tokenizer(base.hf, base.config, template)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(TemplateDeltaError, match="after the last assistant turn starts"):
        open_ended.render_delta(history, [{"role": "user", "content": "again"}], stop_text="<|im_end|>")


def test_llama3_parallel_calls_run_the_first_and_tell_the_model_of_the_rest(llama_dir):
    tok = load_tokenizer(llama_dir)
    traj, _ = _roll(tok, ['{"name": "calculator", "parameters": {"expression": "2 + 3"}}; '
                          '{"name": "calculator", "parameters": {"expression": "1 + 1"}}<|eom_id|>',
                          "<answer>5</answer><|eot_id|>"], "llama3_json")
    assert (traj.error, traj.reward, traj.turns[0].num_tool_calls, traj.turns[0].num_tool_errors) == (None, 1.0, 2, 1)
    results = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert results[0] == "5" and "one tool per turn" in results[1]


def test_mistral_tool_loop_with_ids_its_template_accepts_and_an_unparsed_call_between(tmp_path):
    """Mistral's template refuses a call id or a result id that is not 9 letters or digits: the
    format's ids (the model's own, else call00000...) pass it, for the results of calls that did
    not parse too; the loop runs a broken call, a good one, then the answer."""
    tok = load_tokenizer(build_mistral_style_tokenizer(tmp_path))
    assert infer_format(tok.chat_template_source) == "mistral" and tok.end_of_turn_token == "</s>"
    traj, _ = _roll(tok, ['[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": 2 +}}]</s>',
                          '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "2 + 3"}, '
                          '"id": "Ab3dE6gH9"}]</s>',
                          "<answer>5</answer></s>"], "mistral")
    assert (traj.error, traj.finish_reason, traj.reward, len(traj.turns)) == (None, "answer", 1.0, 3)
    assert [m["tool_call_id"] for m in traj.messages if m["role"] == "tool"] == ["call00000", "Ab3dE6gH9"]
    observation = tok.decode(traj.tokens[traj.turns[1].gen_end:traj.turns[1].obs_end])
    assert observation == '[TOOL_RESULTS] {"content": "5", "call_id": "Ab3dE6gH9"}[/TOOL_RESULTS]'


def test_calls_that_do_not_parse_keep_a_template_that_checks_role_alternation_rendering(tmp_path):
    """Mistral's template counts user and assistant turns without tool results and call turns: a
    turn whose call did not parse (no `tool_calls`), then its result, then the next assistant turn
    would be two assistant turns in a row. The template renders a stand-in call for it instead
    (the user-message fallback cannot serve: Mistral's tools block moves to the last user turn);
    the trajectory's messages keep what the model made."""
    tok = load_tokenizer(build_mistral_style_tokenizer(tmp_path))
    bad = '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": 2 +}}]</s>'
    traj, _ = _roll(tok, [bad, bad, '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "2 + 3"}}]</s>',
                          "<answer>5</answer></s>"], "mistral", max_turns=4)
    assert (traj.error, traj.finish_reason, traj.reward, len(traj.turns)) == (None, "answer", 1.0, 4)
    assistant = [m for m in traj.messages if m["role"] == "assistant"]
    assert ["tool_calls" in m for m in assistant] == [False, False, True, False]
    tool = [m for m in traj.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool] == ["call00000"] * 3
    assert "malformed tool call JSON" in tool[0]["content"] and tool[2]["content"] == "5"
    # the second broken turn's observation is the template's render of its result, after a stand-in call
    observation = tok.decode(traj.tokens[traj.turns[1].gen_end:traj.turns[1].obs_end])
    assert observation.startswith("[TOOL_RESULTS] {") and '"call_id": "call00000"}[/TOOL_RESULTS]' in observation


def test_mistral_calls_past_the_per_turn_cap_get_an_error_with_an_id_its_template_accepts(tmp_path):
    """The loop's own error for the calls past `max_tool_calls_per_turn` carries the first cut
    call's id (call00002 here), so Mistral's template renders it instead of failing the run."""
    tok = load_tokenizer(build_mistral_style_tokenizer(tmp_path))
    call = '{"name": "calculator", "arguments": {"expression": "2 + 3"}}'
    engine = ScriptedEngine([f"[TOOL_CALLS] [{', '.join([call] * 5)}]</s>", "<answer>5</answer></s>"], tokenizer=tok)
    env = calculator_environment()
    try:
        traj = asyncio.run(run_agent(engine, env, arithmetic_task("2 + 3", "t0"), tok,
                                     dataclasses.replace(CFG, tool_format="mistral", max_tool_calls_per_turn=2,
                                                         max_new_tokens_per_turn=1024)))
    finally:
        env.close()
    assert (traj.error, traj.finish_reason, traj.reward) == (None, "answer", 1.0)
    tool = [m for m in traj.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool] == ["call00000", "call00001", "call00002"]
    assert [m["content"] for m in tool[:2]] == ["5", "5"] and "3 more tool calls" in tool[2]["content"]


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


def test_pythonic_tool_loop_over_a_llama4_style_template(tmp_path):
    """Llama 4's layout: the format is read from the template; a call turn stops on <|eom|> (from
    generation_config.json), a broken list and two calls in one turn come back as observations,
    then the answer."""
    tok = load_tokenizer(build_llama4_pythonic_style_tokenizer(tmp_path))
    assert infer_format(tok.chat_template_source) == "pythonic"
    engine = ScriptedEngine(['[calculator(expression="2 + 3")]<|eom|>', '[calculator(expression="2 +)]<|eom|>',
                             '[calculator(expression="1 + 1"), calculator(expression="2 + 3")]<|eom|>',
                             "<answer>5</answer><|eot|>"], tokenizer=tok)
    env = calculator_environment()
    try:
        traj = asyncio.run(run_agent(engine, env, arithmetic_task("2 + 3", "t0"), tok,
                                     dataclasses.replace(CFG, tool_format="pythonic", max_turns=4)))
    finally:
        env.close()
    assert (traj.error, traj.finish_reason, traj.reward, len(traj.turns)) == (None, "answer", 1.0, 4)
    assert tok.token_to_id("<|eom|>") in engine.requests[0].stop_token_ids
    results = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert results[0] == "5" and "malformed pythonic tool call list" in results[1] and results[2:] == ["2", "5"]
    observation = tok.decode(traj.tokens[traj.turns[0].gen_end:traj.turns[0].obs_end])
    assert observation == '<|header_start|>ipython<|header_end|>\n\n"5"<|eot|><|header_start|>assistant<|header_end|>\n\n'


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


def test_llama4_json_tool_loop_runs_two_calls_in_a_turn(tmp_path):
    tok = load_tokenizer(build_llama4_pythonic_style_tokenizer(tmp_path, LLAMA4_JSON_STYLE_TEMPLATE))
    fmt = infer_format(tok.chat_template_source)
    traj, engine = _roll(tok, ['{"name": "calculator", "parameters": {"expression": "1 + 1"}}'
                               '{"name": "calculator", "parameters": {"expression": "2 + 3"}}<|eom|>',
                               "<answer>5</answer><|eot|>"], fmt)
    assert (fmt, traj.error, traj.finish_reason, traj.reward) == ("llama4_json", None, "answer", 1.0)
    assert (traj.turns[0].num_tool_calls, traj.turns[0].num_tool_errors) == (2, 0)
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["2", "5"]
    assert tok.token_to_id("<|eom|>") in engine.requests[0].stop_token_ids


def test_sft_demonstrations_under_a_template_that_shows_the_system_prompt_only_with_a_last_user_message(tmp_path):
    """Mistral v3's template writes the system prompt into the user message only while that is
    the last message, so the prompt is not a prefix of the render once the assistant turn
    follows. The example is laid out as a rollout: the prompt as the rollout's prompt (system
    prompt in it), then each turn as the template writes it, masked 1, and the deltas."""
    tok = load_tokenizer(build_mistral_style_tokenizer(tmp_path))
    task = arithmetic_task("2 + 3", "t0")
    demo = calculator_demonstration(task)
    demo[2]["tool_calls"][0]["id"] = "call00000"      # Mistral's 9-character ids
    demo[3]["tool_call_id"] = "call00000"
    assert demo[0]["role"] == "system"
    tokens, mask = render_sft_example(tok, demo, calculator_tool_schemas())
    prompt = tok.apply_chat_template(demo[:2], calculator_tool_schemas(), add_generation_prompt=True)
    assert tokens[:len(prompt)] == prompt and demo[0]["content"] in tok.decode(prompt)
    learned, run = [], []
    for t, m in zip(tokens, mask):
        if m:
            run.append(t)
        elif run:
            learned, run = learned + [tok.decode(run)], []
    learned += [tok.decode(run)] if run else []
    assert learned == ['[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "2 + 3"}, "id": "call00000"}]</s>',
                       " <answer>5</answer></s>"]


def test_the_default_format_is_the_templates_own_and_a_template_without_call_markup_is_refused(llama_dir, tmp_path):
    """AgentConfig.tool_format None (the default) reads the format from the chat template: a
    Llama 3.1 one runs its JSON calls. A template that writes no call markup (SmolLM2's) cannot
    say how the model calls tools: with tools the rollout is refused, naming the setting, where
    the compact default read every call as an answer."""
    assert AgentConfig().tool_format is None
    tok = load_tokenizer(llama_dir)
    traj, _ = _roll(tok, ['{"name": "calculator", "parameters": {"expression": "2 + 3"}}<|eom_id|>',
                          "<answer>5</answer><|eot_id|>"], None)
    assert (traj.error, traj.reward, traj.turns[0].num_tool_calls) == (None, 1.0, 1)
    plain = build_qwen3_style_tokenizer(tmp_path, "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                                                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                                                  "<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match="writes no tool-call markup.*set AgentConfig.tool_format"):
        _roll(load_tokenizer(plain), ["<answer>5</answer><|im_end|>"], None)


# ----------------------------------------------------------------------------- template variables, new user turns

class _AskedTwice:
    """The calculator environment whose user asks again once the model has answered: a new user
    turn appended to the trajectory like a tool result (BFCL multi-turn does the same)."""

    def __init__(self):
        self.env = calculator_environment()

    def tool_schemas(self):
        return self.env.tool_schemas()

    def reset(self, task):
        return self.env.reset(task)

    async def step(self, calls):
        return await self.env.step(calls)

    def reward(self, task, trajectory):
        return float("<answer>6</answer>" in trajectory.final_text)

    def open_episode(self, task):
        outer, asked = self, []

        class Episode:
            def reset(self):
                return outer.env.reset(task)

            async def step(self, calls):
                return await outer.env.step(calls)

            def next_user_turn(self):
                if asked:
                    return None
                asked.append(True)
                return [{"role": "user", "content": "And 2 + 4?"}]

            def close(self):
                pass
        return Episode()


def _roll_twice(tok, turns, **config):
    engine, env = ScriptedEngine(turns, tokenizer=tok), _AskedTwice()
    try:
        traj = asyncio.run(run_agent(engine, env, arithmetic_task("2 + 3", "t0"), tok,
                                     dataclasses.replace(CFG, max_turns=4, **config)))
    finally:
        env.env.close()
    return traj, engine


def test_a_new_user_turn_under_mistral_which_moves_its_tools_block_to_the_last_user_message(tmp_path):
    """Mistral's template writes the tools block before the last user message, and v3 the system
    prompt into it: once the user speaks again the history renders otherwise before the answer.
    The delta is the new user message with both, as a fresh render shows them to the model."""
    tok = load_tokenizer(build_mistral_style_tokenizer(tmp_path))
    traj, _ = _roll_twice(tok, ['[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "2 + 3"}}]</s>',
                                "<answer>5</answer></s>", "<answer>6</answer></s>"])
    assert (traj.error, traj.finish_reason, traj.reward, len(traj.turns)) == (None, "answer", 1.0, 3)
    delta = tok.decode(traj.tokens[traj.turns[1].gen_end:traj.turns[1].obs_end])
    system = traj.messages[0]["content"]
    assert delta.startswith("[AVAILABLE_TOOLS]") and delta.endswith(f"[/AVAILABLE_TOOLS][INST] {system}\n\nAnd 2 + 4?[/INST]")
    assert delta.count("[INST]") == 1 and "<answer>5</answer>" not in delta


def test_chat_template_variables_reach_every_render_qwen3_without_thinking(tmp_path):
    """AgentConfig.chat_template_kwargs: Qwen3's enable_thinking=False writes an empty think block
    into the generation prompt, which the template drops once the turn is not last; the loop goes
    on, and every render (prompt, deltas) has the variable."""
    call_turn = "<|im_start|>assistant\n{% if m.content %}"
    template = (QWEN3_STYLE_TEMPLATE
                .replace(call_turn, "<|im_start|>assistant\n{% if loop.last %}<think>\n\n</think>\n\n{% endif %}"
                                    "{% if m.content %}")
                .replace("{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
                         "{% if add_generation_prompt %}<|im_start|>assistant\n"
                         "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                         "{% endif %}"))
    tok = load_tokenizer(build_qwen3_style_tokenizer(tmp_path, template))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call><|im_end|>'
    traj, engine = _roll_twice(tok, [call, "<answer>5</answer><|im_end|>", "<answer>6</answer><|im_end|>"],
                               chat_template_kwargs={"enable_thinking": False}, tool_format="qwen3")
    assert (traj.error, traj.finish_reason, traj.reward, len(traj.turns)) == (None, "answer", 1.0, 3)
    assert all(tok.decode(r.tokens).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for r in engine.requests)
    assert tok.with_template_kwargs(enable_thinking=False).template_kwargs == {"enable_thinking": False}
    assert tok.template_kwargs == {}    # the loop binds a copy
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        AgentConfig(chat_template_kwargs={"enable thinking": False})
