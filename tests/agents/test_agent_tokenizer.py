"""The tiny tokenizer: deterministic build, HF-compatible directory, chat template, delta rendering."""
import json

import pytest

from sfrrl_jax.tokenizer import (TINY_VOCAB_SIZE, TemplateDeltaError, Tokenizer, build_tiny_tokenizer,
                                 load_tokenizer)

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Compute 48213 * 9172 + 7."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "48213*9172"}}}]},
    {"role": "tool", "name": "calculator", "content": "442209636"},
    {"role": "assistant", "content": "Now add.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "442209636+7"}}},
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression":"1+1"}'}}]},
    {"role": "tool", "name": "calculator", "content": "442209643"},
    {"role": "tool", "name": "calculator", "content": "2"},
    {"role": "assistant", "content": "<answer>442209643</answer>"},
]


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_build_is_deterministic_and_small(tok_dir, tmp_path):
    again = build_tiny_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tok_dir / name).read_bytes() == (again / name).read_bytes()
    assert load_tokenizer(tok_dir).vocab_size <= TINY_VOCAB_SIZE


def test_special_tokens_and_round_trip(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.end_of_turn_id == tok.token_to_id("<|end|>")
    assert tok.stop_token_ids == (tok.end_of_turn_id, tok.eos_id)
    text = "Compute (48213 * 9172) - 55311 = ? ünïcödé 🙂 <answer>-5</answer>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert [tok.id_to_token(i) for i in tok.encode("90210")] == ["9", "0", "2", "1", "0"]  # one token per digit
    assert tok.encode("<|call|>x<|end|>")[0] == tok.token_to_id("<|call|>")


def test_compact_render_exact(tok):
    text = tok.render(CONVERSATION[:4], TOOLS, add_generation_prompt=True)
    schema = json.dumps(TOOLS[0]["function"], separators=(",", ":"))
    assert text == (
        "<|bos|><|system|>You are a careful assistant.<|tools|>" + schema + "\n<|end|>"
        "<|user|>Compute 48213 * 9172 + 7.<|end|>"
        '<|assistant|><|call|>calculator{"expression":"48213*9172"}<|/call|><|end|>'
        "<|tool|>442209636<|end|><|assistant|>")
    assert tok.apply_chat_template(CONVERSATION[:4], TOOLS, add_generation_prompt=True) == tok.encode(text)


def test_matches_transformers_apply_chat_template(tok_dir, tok):
    import transformers  # the `hf` extra, installed in our environment
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    for n in (2, 4, len(CONVERSATION)):
        ours = tok.apply_chat_template(CONVERSATION[:n], TOOLS, add_generation_prompt=n < len(CONVERSATION))
        theirs = hf.apply_chat_template(CONVERSATION[:n], tools=TOOLS, add_generation_prompt=n < len(CONVERSATION),
                                        tokenize=True, return_dict=False)
        assert ours == list(theirs)
    assert hf.decode(tok.encode("12 + 3")) == "12 + 3"


def test_full_render_equals_prefix_plus_generated_plus_deltas(tok):
    """Build the conversation turn by turn as the loop does; generated tokens are kept as generated."""
    tokens = tok.apply_chat_template(CONVERSATION[:2], TOOLS, add_generation_prompt=True)
    history = list(CONVERSATION[:2])
    i = 2
    while i < len(CONVERSATION):
        assistant = CONVERSATION[i]
        before = tok.render(history, TOOLS, add_generation_prompt=True)
        with_turn = tok.render(history + [assistant], TOOLS)
        generated = tok.encode(with_turn[len(before):])  # what the policy emitted, ending in <|end|>
        assert generated[-1] == tok.end_of_turn_id
        tokens += generated
        history.append(assistant)
        j = i + 1
        while j < len(CONVERSATION) and CONVERSATION[j]["role"] == "tool":
            j += 1
        if j < len(CONVERSATION):
            tokens += tok.render_delta(history, CONVERSATION[i + 1:j], TOOLS)
            history += CONVERSATION[i + 1:j]
        i = j
    assert tokens == tok.apply_chat_template(CONVERSATION, TOOLS)
    # And the delta for the 2 results is exactly their two tool blocks plus the generation prompt.
    delta = tok.render_delta(CONVERSATION[:5], CONVERSATION[5:7], TOOLS)
    assert tok.decode(delta) == "<|tool|>442209643<|end|><|tool|>2<|end|><|assistant|>"


CHATML_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_loader_reads_other_directories_and_infers_end_of_turn(tok_dir, tmp_path):
    """A Qwen-style (ChatML) directory: chat_template.jinja file, AddedToken dicts, <|im_end|> stop."""
    hf = load_tokenizer(tok_dir).hf
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "<|pad|>", "bos_token": None}))
    (tmp_path / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    other = load_tokenizer(tmp_path)
    assert other.bos_id is None and other.end_of_turn_token == "<|im_end|>"
    assert other.stop_token_ids == (other.token_to_id("<|im_end|>"),)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    delta = other.render_delta(history, [{"role": "tool", "content": "42"}])
    assert other.decode(delta) == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" \
                                  "<|im_start|>assistant\n"


def test_delta_after_a_template_that_rewrites_the_history_holds_the_new_messages_or_is_refused(tok_dir):
    """Mistral's templates move the tools block (v3: the system prompt too) to the last user
    message, so the history before the turn renders otherwise once a user speaks again. The
    delta is what follows the turn's close in the new render (the turn ends at the same count of
    its close); it must hold the new messages, else the template is refused."""
    base = load_tokenizer(tok_dir)
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    # the first user turn rendered otherwise once more than two messages are rendered
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{{ m.content }}<|end|>"
                "{% elif loop.length > 2 and loop.first %}<|user|>[old]<|end|>{% else %}<|user|>{{ m.content }}"
                "<|end|>{% endif %}{% endfor %}")
    rewriting = Tokenizer(base.hf, base.config, template)
    assert rewriting.decode(rewriting.render_delta(history, [{"role": "user", "content": "c"}])) == "<|user|>c<|end|>"
    # the new contents as templates write them: `| tojson` escapes quotes (gpt-oss's tool results)
    quoting = Tokenizer(base.hf, base.config, template.replace("{% else %}<|user|>{{ m.content }}",
                                                               "{% else %}<|user|>{{ m.content | tojson }}"))
    delta = quoting.render_delta(history, [{"role": "user", "content": 'say "hi"'}])
    assert quoting.decode(delta) == '<|user|>"say \\"hi\\""<|end|>'
    # a template that loses the new message (a user turn after an answer is not rendered)
    dropping = Tokenizer(base.hf, base.config, template.replace("{% else %}<|user|>{{ m.content }}",
                                                                "{% elif loop.index0 < 2 %}<|user|>{{ m.content }}"))
    with pytest.raises(TemplateDeltaError, match="first difference"):
        dropping.render_delta(history, [{"role": "user", "content": "c"}])


def test_delta_follows_a_template_that_renders_the_last_turn_otherwise_once_it_is_not_last(tok_dir):
    """Qwen3's template writes an empty <think></think> block into the last assistant turn only:
    the history before the turn is the same, so the delta is what follows the turn's close in the
    new render (the trajectory keeps the tokens the model generated)."""
    base = load_tokenizer(tok_dir)
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>"
                "{% if loop.last %}<think></think>{% endif %}{{ m.content }}<|end|>"
                "{% else %}<|user|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    thinking = Tokenizer(base.hf, base.config, template)
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert thinking.render(history).endswith("<|assistant|><think></think>b<|end|>")
    delta = thinking.render_delta(history, [{"role": "user", "content": "c"}])
    assert thinking.decode(delta) == "<|user|>c<|end|><|assistant|>"


def test_loader_errors(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match="eos_token '<\\|nope\\|>' is not in the vocabulary"):
        load_tokenizer(tmp_path)
