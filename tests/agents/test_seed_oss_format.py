"""ByteDance Seed-OSS's tool calls (`SeedOssFormat`: Qwen3-Coder's XML in <seed:tool_call> blocks):
parsing, and the agent loop and SFT over a template written after its published prompt format."""
from sfrrl_jax.agents import ParsedTurn
from sfrrl_jax.agents.formats.registry import SeedOssFormat, get_format, infer_format
from sfrrl_jax.tokenizer import load_tokenizer

_END = "<seed:eos>"
_TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {
    "expression": {"type": "string"}, "digits": {"type": "integer"}, "exact": {"type": "boolean"}}}}}]


def _call(name, **params):
    body = "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in params.items())
    return f"\n<seed:tool_call>\n<function={name}>\n{body}</function>\n</seed:tool_call>"


def test_seed_calls_in_seed_tags_read_by_their_schemas():
    parse = SeedOssFormat().with_tools(_TOOLS).parse
    turn = parse("<seed:think>use the tool</seed:think>\nLet me compute." + _call("calc", expression="2 + 3", digits=4,
                                                                               exact=True) + _call("calc", expression=7)
                 + _END)
    assert (turn.reasoning, turn.content) == ("use the tool", "Let me compute.")
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("calc", {"expression": "2 + 3", "digits": 4, "exact": True}), ("calc", {"expression": "7"})]
    assert parse("<seed:think>x</seed:think>\n<answer>5</answer>" + _END) == ParsedTurn("<answer>5</answer>",
                                                                                       reasoning="x")
    # Qwen3-Coder's own tags are not Seed's calls
    assert parse("<tool_call>\n<function=calc>\n</function>\n</tool_call>").calls == ()
    assert any("unterminated" in e.message for e in parse("<seed:tool_call>\n<function=calc>\n").errors)
    assert infer_format("{%- set toolcall_begin_token = '<seed:tool_call>' -%} <function=f>") == "seed_oss"
    assert infer_format("<tool_call>\n<function=f>") == "qwen3_xml"
    assert get_format("seed_oss") == SeedOssFormat()


def test_seed_tool_loop_and_sft_over_a_seed_style_template(tmp_path):
    from sfrrl_jax.agents import calculator_demonstration, calculator_tool_schemas
    from sfrrl_jax.agents.tasks.demos import render_sft_example
    from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
    from family_tokenizer_fixtures import SEED_OSS_STYLE_TEMPLATE, build_seed_oss_style_tokenizer
    from test_model_formats import _calculator_loop

    tok = load_tokenizer(build_seed_oss_style_tokenizer(tmp_path))
    assert infer_format(tok.chat_template_source) == infer_format(SEED_OSS_STYLE_TEMPLATE) == "seed_oss"
    call = _call("calculator", expression="2 + 3")
    observation = _calculator_loop(tok, ["<seed:think>add</seed:think>" + call + _END, "<answer>5</answer>" + _END])
    assert observation == "<seed:bos>tool\n5<seed:eos><seed:bos>assistant\n"
    demo = calculator_demonstration(arithmetic_task("2 + 3 - 1", "t"))
    tokens, mask = render_sft_example(tok, demo, calculator_tool_schemas())
    learned = tok.decode([t for t, m in zip(tokens, mask) if m])
    assert _call("calculator", expression="5 - 1").lstrip("\n") + _END in learned
    assert learned.endswith("<answer>4</answer>" + _END)
    assert tokens == tok.apply_chat_template(demo, calculator_tool_schemas())
