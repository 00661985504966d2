"""TokenizerProtocol: the library's Tokenizer meets it, and a minimal user tokenizer that meets it
is enough to run the real agent loop (against the scripted engine)."""
import asyncio
import json

from sfrrl_jax.agents.tasks.environments import calculator_environment
from sfrrl_jax.agents.loop import AgentConfig, run_agent
from sfrrl_jax.agents.tasks.builtin_kinds import arithmetic_task
from sfrrl_jax.testing import ScriptedEngine
from sfrrl_jax.tokenizer import Tokenizer, TokenizerProtocol, load_tokenizer


class CharTokenizer:
    """A user's own tokenizer: one id per control token, then one per character (id 8 + ord).

    Its template is `<|role|>content<|end|>` per message; tool contents are encoded as plain
    characters, so a tool printing '<|end|>' cannot end a turn.
    """

    SPECIALS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>", "<|call|>", "<|/call|>", "<|pad|>")

    def __init__(self):
        self.ids = {s: i for i, s in enumerate(self.SPECIALS)}

    vocab_size = 8 + 0x110000
    end_of_turn_token = "<|end|>"

    @property
    def stop_token_ids(self):
        return (self.ids["<|end|>"],)

    def _plain(self, text):
        return [8 + ord(c) for c in text]

    def encode(self, text):
        out, i = [], 0
        while i < len(text):
            special = next((s for s in self.SPECIALS if text.startswith(s, i)), None)
            out.append(self.ids[special] if special else 8 + ord(text[i]))
            i += len(special) if special else 1
        return out

    def decode(self, ids):
        return "".join(self.SPECIALS[i] if i < 8 else chr(i - 8) for i in ids)

    def _content(self, message):
        calls = "".join(f"<|call|>{c['function']['name']}{json.dumps(c['function']['arguments'])}<|/call|>"
                        for c in message.get("tool_calls", ()))
        return (message.get("content") or "") + calls

    def render(self, messages, tools=None, add_generation_prompt=False):
        text = "".join(f"<|{m['role']}|>{self._content(m)}<|end|>" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def _ids(self, messages, add_generation_prompt):
        out = []
        for m in messages:
            body = self._plain if m["role"] == "tool" else self.encode   # untrusted: plain text
            out += [self.ids[f"<|{m['role']}|>"]] + body(self._content(m)) + [self.ids["<|end|>"]]
        return out + ([self.ids["<|assistant|>"]] if add_generation_prompt else [])

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False):
        return self._ids(messages, add_generation_prompt)

    def render_delta(self, history, new_messages, tools=None, add_generation_prompt=True, stop_text=None):
        # append-only template: what follows a closed assistant turn is the new messages' render
        return self._ids(new_messages, add_generation_prompt)


def test_the_library_tokenizer_meets_the_protocol(tok_dir):
    tok = load_tokenizer(tok_dir)
    assert isinstance(tok, Tokenizer) and isinstance(tok, TokenizerProtocol)
    # the stated shapes
    ids = tok.encode("<answer>42</answer><|end|>")
    assert all(type(i) is int and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == "<answer>42</answer><|end|>"
    assert tok.stop_token_ids[0] == tok.encode(tok.end_of_turn_token)[0] and len(tok.encode(tok.end_of_turn_token)) == 1
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, None, True) == tok.encode(tok.render(messages, None, True))


def test_a_minimal_user_tokenizer_meets_it_and_runs_the_agent_loop():
    tok = CharTokenizer()
    assert isinstance(tok, TokenizerProtocol)


    class EncodeDecodeOnly:   # a plain text tokenizer: no chat template, no deltas
        vocab_size, encode, decode = CharTokenizer.vocab_size, CharTokenizer.encode, CharTokenizer.decode
    assert not isinstance(EncodeDecodeOnly(), TokenizerProtocol)

    env = calculator_environment()
    task = arithmetic_task("17 + 25", "t0")
    call = '<|call|>calculator{"expression":"17 + 25"}<|/call|><|end|>'
    answer = "<answer>42</answer><|end|>"
    # it shows no chat template source to read the tool-call format from: the library's own
    # (compact) format is the default, as named
    engine = ScriptedEngine([call, answer], tokenizer=tok)
    traj = asyncio.run(run_agent(engine, env, task, tok, AgentConfig()))
    assert (traj.finish_reason, traj.reward, traj.num_tool_calls) == ("answer", 1.0, 1)
    prompt = tok.apply_chat_template(env.reset(task), env.tool_schemas(), add_generation_prompt=True)
    observation = tok.encode("<|tool|>42<|end|><|assistant|>")
    assert traj.tokens == prompt + tok.encode(call) + observation + tok.encode(answer)
    assert [r.tokens for r in engine.requests] == [prompt, observation]
    assert all(r.stop_token_ids == tok.stop_token_ids for r in engine.requests)
    traj.check()
