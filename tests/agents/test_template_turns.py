"""The agent loop over each model family's chat template: tool turns, answers and new user turns
appended as deltas where templates are not append-only (a turn's close or the history before it
rendered otherwise once more follows), calls that do not parse under strict templates, SFT
demonstrations laid out as rollouts, and chat-template variables."""
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import pytest

from sfrrl_jax.agents import (AgentConfig, calculator_demonstration, calculator_environment, calculator_tool_schemas,
                              render_sft_example, run_agent)
from sfrrl_jax.agents.formats.registry import infer_format
from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
from sfrrl_jax.testing.scripted_engine import ScriptedEngine
from sfrrl_jax.tokenizer import load_tokenizer

from family_tokenizer_fixtures import (LLAMA4_JSON_STYLE_TEMPLATE, LLAMA4_PYTHONIC_STYLE_TEMPLATE,
                                      MISTRAL_STYLE_TEMPLATE, build_gemma3_style_tokenizer,
                                      build_llama4_pythonic_style_tokenizer,
                                      build_mistral_style_tokenizer, qwen3_xml_call)

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoints"))
from hf_tokenizer_fixtures import QWEN3_STYLE_TEMPLATE, build_qwen3_style_tokenizer  # noqa: E402


# ----------------------------------------------------------------------------- the loop over each family

CFG = AgentConfig(max_turns=3, max_new_tokens_per_turn=96, max_total_tokens=2048, temperature=0.0)


def _learned_spans(tok, tokens, mask) -> list[str]:
    """The texts of the runs of tokens an SFT example learns (mask 1), in order."""
    spans, run = [], []
    for t, m in zip(list(tokens) + [0], list(mask) + [0]):
        if m:
            run.append(t)
        elif run:
            spans, run = spans + [tok.decode(run)], []
    return spans


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
    traj, _ = _roll(tok, [qwen3_xml_call("calculator", expression="2 + 3") + "<|im_end|>", "<answer>5</answer><|im_end|>"],
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
    assert _learned_spans(tok, tokens, mask) == ["<|channel|>final<|message|><answer>5</answer><|return|>",
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
    user's, and cutting there would append the assistant turn a second time. The delta starts
    after the turn instead, with the next message as the template opens it (GLM-4.5's template
    closes no turn: the next message's opener ends it)."""
    from sfrrl_jax.tokenizer import Tokenizer
    base = load_tokenizer(build_qwen3_style_tokenizer(tmp_path))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "{% if m.role != 'assistant' %}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    open_ended = Tokenizer(base.hf, base.config, template)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    delta = open_ended.render_delta(history, [{"role": "user", "content": "again"}], stop_text="<|im_end|>")
    assert base.decode(delta) == "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


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


# ----------------------------------------------------------------------------- Llama 4, SFT, the default format

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
    learned = _learned_spans(tok, tokens, mask)
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


def _two_step_demo() -> list[dict]:
    return calculator_demonstration(arithmetic_task("2 + 3 - 1", "t"))   # two calls: 2 + 3, then 5 - 1


def test_sft_examples_read_back_as_their_calls_else_the_template_is_refused(tmp_path):
    """render_sft_example reads every learned turn with the rollout's format: a template that
    writes calls the format cannot read would teach the model turns every rollout misreads."""
    demo = _two_step_demo()
    tools = calculator_tool_schemas()
    good = load_tokenizer(build_llama4_pythonic_style_tokenizer(tmp_path / "good"))
    tokens, mask = render_sft_example(good, demo, tools)
    assert '[calculator(expression="5 - 1")]' in good.decode([t for t, m in zip(tokens, mask) if m])
    # vLLM's Llama 3.2 pythonic template writes string arguments unquoted: calculator(expression=2 + 3)
    unquoted = LLAMA4_PYTHONIC_STYLE_TEMPLATE.replace("{{ k }}={{ v | tojson }}", "{{ k }}={{ v }}")
    assert unquoted != LLAMA4_PYTHONIC_STYLE_TEMPLATE
    bad = load_tokenizer(build_llama4_pythonic_style_tokenizer(tmp_path / "unquoted", unquoted))
    with pytest.raises(ValueError, match=r"message 2: .*calculator\(expression=2 \+ 3\).*PythonicFormat.*error"):
        render_sft_example(bad, demo, tools)
    # vLLM's Mistral template writes [TOOL_CALLS] without the calls
    start = MISTRAL_STYLE_TEMPLATE.index("[TOOL_CALLS] [")
    end = MISTRAL_STYLE_TEMPLATE.index("{%- endfor %}]{{ eos_token }}", start) + len("{%- endfor %}]{{ eos_token }}")
    no_calls = MISTRAL_STYLE_TEMPLATE[:start] + "[TOOL_CALLS]{{ eos_token }}" + MISTRAL_STYLE_TEMPLATE[end:]
    mistral_demo = [dict(m) for m in demo]
    for m in mistral_demo:
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(m["tool_calls"][0], id="call00000")]
        if m["role"] == "tool":
            m["tool_call_id"] = "call00000"
    render_sft_example(load_tokenizer(build_mistral_style_tokenizer(tmp_path / "mistral")), mistral_demo, tools)
    with pytest.raises(ValueError, match=r"message 2: .*'\[TOOL_CALLS\]</s>'.*MistralFormat"):
        render_sft_example(load_tokenizer(build_mistral_style_tokenizer(tmp_path / "no_calls", no_calls)),
                           mistral_demo, tools)


def test_sft_examples_refuse_answers_read_as_calls_and_a_format_the_template_does_not_write(tmp_path):
    tok = load_tokenizer(build_qwen3_style_tokenizer(tmp_path))
    demo, tools = _two_step_demo(), calculator_tool_schemas()
    tokens, _ = render_sft_example(tok, demo, tools)
    assert tokens == render_sft_example(tok, demo, tools, tool_format="qwen3")[0]
    # the rollout reading these turns as pythonic would see answers, not calls
    with pytest.raises(ValueError, match=r"message 2: .*an answer without calls.*calculator\("):
        render_sft_example(tok, demo, tools, tool_format="pythonic")
    # an answer that holds call markup is read as a call: the model would learn to call
    sneaky = demo[:-1] + [{"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": '
                                                          '{"expression": "1 + 1"}}\n</tool_call>'}]
    with pytest.raises(ValueError, match=r"message 6: .*calculator\(\{\"expression\": \"1 \+ 1\"\}\).*\(none\)"):
        render_sft_example(tok, sneaky, tools)
    # calls whose arguments are a JSON string (OpenAI's wire form) compare by value (this template
    # writes the string as it is given, which the format decodes)
    wire = [dict(m, tool_calls=[{"id": c["id"], "type": "function",
                                 "function": {"name": c["function"]["name"],
                                              "arguments": json.dumps(c["function"]["arguments"])}}
                                for c in m["tool_calls"]]) if m.get("tool_calls") else m for m in demo]
    wire_tokens, wire_mask = render_sft_example(tok, wire, tools)
    assert wire_tokens != tokens and sum(wire_mask) > 0
    broken = [dict(m) for m in wire]
    broken[2] = dict(broken[2], tool_calls=[{"id": "call_0",
                                              "function": {"name": "calculator", "arguments": "{2 + 3"}}])
    with pytest.raises(ValueError, match=r"message 2: tool call 'calculator' has arguments that are not JSON"):
        render_sft_example(tok, broken, tools)


def test_sft_examples_under_a_template_whose_markup_no_format_reads_are_checked_only_with_a_given_format(tmp_path):
    """The rollout refuses such a template with tools; SFT alone renders it as it is, and reads
    the turns back only with a format the caller names."""
    template = QWEN3_STYLE_TEMPLATE.replace("<tool_call>", "<fn>").replace("</tool_call>", "</fn>")
    tok = load_tokenizer(build_qwen3_style_tokenizer(tmp_path, template))
    assert infer_format(tok.chat_template_source) is None
    demo, tools = _two_step_demo(), calculator_tool_schemas()
    tokens, mask = render_sft_example(tok, demo, tools)
    assert '<fn>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</fn>' in tok.decode(tokens)
    with pytest.raises(ValueError, match=r"message 2: .*Qwen3Format.*an answer without calls"):
        render_sft_example(tok, demo, tools, tool_format="qwen3")


def test_gemma3s_template_folds_the_system_prompt_trims_and_closes_turns_with_a_newline(tmp_path):
    """Gemma 3 has no system role and writes a newline after each <end_of_turn>: an answer is
    learned with the stop it generates, and a new user turn's delta starts with that newline."""
    tok = load_tokenizer(build_gemma3_style_tokenizer(tmp_path))
    assert tok.end_of_turn_token == "<end_of_turn>" and infer_format(tok.chat_template_source) is None
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "<answer>5</answer>"}, {"role": "user", "content": "And 2 + 4?"},
            {"role": "assistant", "content": "<answer>6</answer> "}]
    tokens, mask = render_sft_example(tok, chat)
    learned = _learned_spans(tok, tokens, mask)
    assert learned == ["<answer>5</answer><end_of_turn>", "<answer>6</answer><end_of_turn>"]
    assert tok.decode(tokens).startswith("<bos><start_of_turn>user\nBe brief.\n\nWhat is 2 + 3?<end_of_turn>\n")
    delta = tok.decode(tok.render_delta(chat[:3], chat[3:4], None, stop_text="<end_of_turn>"))
    assert delta == "\n<start_of_turn>user\nAnd 2 + 4?<end_of_turn>\n<start_of_turn>model\n"
