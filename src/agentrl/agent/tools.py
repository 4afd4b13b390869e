"""Tools the policy can call, and the two ways a call is written in text (tool-call formats).

A tool is a plain Python function `f(expression: str) -> str` (type hints and a Google-style docstring,
so TRL's native `GRPOTrainer(tools=[...])` can describe it too). `agent.tools` names them: a registry
name (`calculator`) or a custom `module:function`, like the rewards. A tool never raises into the
generation loop: `call_tool` turns every failure into an `error: ...` string for the policy and counts it.

Formats (`agent.format`):
  inline  GSM8K's calculator annotation: the policy writes `<<48/2=`, the loop appends `24>>` (tokens
          never sampled) and the policy continues. One tool (the first in agent.tools) serves it.
  chat    Qwen3-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` ends the
          assistant turn; the result comes back as a `<tool_response>` turn and the policy continues.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import json
import re
from dataclasses import dataclass
from typing import Callable, Optional

from ..envs import mixture
from ..envs.calculator import Calculator, ToolError, calculator
from ..envs.contract import EnvironmentLost, environment_tools
from ..envs.registry import MIXTURE, ImportPathError, call_tool, environment_spec, get_environment, import_path
from ..envs.tasks import TOOLS

MAX_RESULT_CHARS = 200  # a tool result longer than this is cut (what the policy reads back)


def get_tool(name: str) -> Callable[..., str]:
    """A tool by registry name or `module:function` import path.

    Args:
        name: a registry name (`calculator`) or `module:function`.

    Returns:
        The tool function. ValueError naming an unknown or uncallable tool.
    """
    if name in TOOLS:
        return TOOLS[name]
    if ":" in name:
        fn = import_path(name, "agent.tools: cannot import custom tool")
        if not callable(fn):
            raise ImportPathError(f"agent.tools: '{name}' is not callable")
        return fn
    raise ValueError(
        f"agent.tools: unknown tool '{name}'; known: {', '.join(sorted(TOOLS))} (or a custom one as 'module:function')"
    )


# ----------------------------------------------------------------------------------- formats
# Qwen3's tags are non-special added tokens (`split_special_tokens` does not split them) and <|...|> are control
# tokens: spelled inside a result they would tokenize as protocol, closing the response and forging a call. A
# space after the `<` keeps them text, as InlineFormat's results have `<<` -> `< <` (Episode.run). Both formats.
PROTOCOL_TAG = re.compile(r"<(?=/?(?:tool_call|tool_response|think)>|\|[^<>|\s]*\|>)")


@dataclass
class Call:
    """One tool call found in the policy's text: which tool, its arguments, the text that opened it."""

    name: str
    arguments: dict


class InlineFormat:
    """`<<expr=` opens a calculator call; the loop appends `result>>`."""

    name = "inline"
    trigger = "="  # a call can only be complete after a token containing this

    def open_call(self, text: str, at_eos: bool = False) -> Optional[Call]:
        if at_eos:
            return None
        start = text.rfind("<<")
        if start < 0 or text.rfind(">>") > start:
            return None
        inside = text[start + 2 :]
        if "=" not in inside:
            return None
        return Call("", {"expression": inside[: inside.index("=")]})

    def open_calls(self, text: str, at_eos: bool = False) -> list[Call]:
        call = self.open_call(text, at_eos)
        return [call] if call is not None else []

    def render_result(self, result: str) -> str:
        return f"{PROTOCOL_TAG.sub('< ', result)}>>"  # a result's `<|im_end|>` stays text (issue 56), as in chat

    def render_results(self, results: list[str]) -> str:
        return "".join(self.render_result(r) for r in results)

    def render_call(self, call: Call) -> str:
        return f"<<{next(iter(call.arguments.values()))}="


class ChatFormat:
    """Qwen3's tool-call turns: the policy ends its turn after `</tool_call>`; the tool's result comes
    back in a user turn `<tool_response>...</tool_response>` (Qwen3's chat template renders tool
    messages this way) and a new assistant turn starts."""

    name = "chat"
    trigger = ">"

    def __init__(self, eos_token: str = "<|im_end|>"):
        self.eos_token = eos_token

    def open_call(self, text: str, at_eos: bool = False) -> Optional[Call]:
        calls = self.open_calls(text, at_eos)
        return calls[-1] if calls else None

    def open_calls(self, text: str, at_eos: bool = False) -> list[Call]:
        """Every call of the assistant turn that just ended: Qwen3 writes parallel calls as consecutive
        `<tool_call>` blocks, and TRL's loop runs them all, in order (their results come back in one user turn)."""
        stripped = text.rstrip()
        if not at_eos or not stripped.endswith("</tool_call>"):
            return []
        turn = stripped.rpartition("<|im_start|>assistant\n")[2]
        return [self._parse(body.strip()) for body in re.findall(r"<tool_call>(.*?)</tool_call>", turn, flags=re.S)]

    @staticmethod
    def _parse(body: str) -> Call:
        try:
            payload = json.loads(body)
            name, arguments = payload["name"], payload.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("name must be a string and arguments an object")
        except (ValueError, KeyError, TypeError) as error:
            return Call("<invalid>", {"error": f"invalid tool call: {error}"})
        return Call(name, arguments)

    def render_result(self, result: str) -> str:
        return self.render_results([result])

    _PROTOCOL_TAG = PROTOCOL_TAG

    def render_results(self, results: list[str]) -> str:
        """The tool turn after a call turn: one user turn with a `<tool_response>` per result, as Qwen3's template
        renders consecutive tool messages (and TRL's loop appends them)."""
        body = "".join(f"\n<tool_response>\n{self._PROTOCOL_TAG.sub('< ', r)}\n</tool_response>" for r in results)
        return f"\n<|im_start|>user{body}{self.eos_token}\n<|im_start|>assistant\n"

    def render_call(self, call: Call) -> str:
        body = json.dumps({"name": call.name or "calculator", "arguments": call.arguments})  # as Qwen3 renders it
        return f"<tool_call>\n{body}\n</tool_call>"


def functions_environment(names: list[str]) -> type:
    """`agent.tools` (plain functions) as one stateless environment class: the calculator's is `Calculator`;
    custom functions become static methods of a generated class (TRL's loop sees the same tools).

    Args:
        names: agent.tools: registry names or `module:function` paths.

    Returns:
        The environment class whose methods are the tools.
    """
    if list(names) == ["calculator"]:
        return Calculator
    tools = {n.rpartition(":")[2]: get_tool(n) for n in names}
    return type("Tools", (), {"reset": lambda self, **row: None, **{k: staticmethod(f) for k, f in tools.items()}})


@functools.lru_cache(maxsize=1024)
def _first_param_of(fn) -> Optional[str]:
    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    except (TypeError, ValueError):
        return None
    return params[0].name if params else None


def _first_param(fn) -> Optional[str]:
    """The name of a tool's first argument (a bound method's function is looked up once, not per call)."""
    fn = getattr(fn, "__func__", fn)
    try:
        return _first_param_of(fn)
    except TypeError:  # an unhashable callable
        return _first_param_of.__wrapped__(fn)


_POOL: list = []  # the thread that runs tool calls (replaced when a call hangs)


def _run_with_timeout(fn, kwargs: dict, timeout_s: Optional[float]):
    """fn(**kwargs), or TimeoutError after timeout_s. A hung call is abandoned on its thread (Python cannot
    kill it) and a fresh thread serves the next calls."""
    if not timeout_s:
        return fn(**kwargs)
    if not _POOL:
        _POOL.append(concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-tool"))
    future = _POOL[0].submit(fn, **kwargs)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        _POOL.pop().shutdown(wait=False)
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None


class Episode:
    """One environment instance for one completion: reset with the completion's row, then its tools run the
    calls the policy makes. Nothing here raises into the loop: an environment that raises, hangs or answers
    junk gives an `error: ...` result (counted as a failed call)."""

    def __init__(self, toolset: "Toolset", row: Optional[dict] = None):
        self.toolset = toolset
        self.observation: Optional[str] = None
        self.broken: Optional[str] = None
        self._open = True  # until close()
        factory = toolset.factory_for(row)  # a mixture row without a member is a data error: raised, not an episode
        try:
            self.env = factory()
            obs = _run_with_timeout(self.env.reset, dict(row or {}), toolset.timeout_s)  # a hung reset is an error too
            self.observation = None if obs is None else str(obs)
        except Exception as error:  # noqa: BLE001 - an environment's failure is data, never a crash
            # the reason whole (a server's refusal, e.g. "Server at capacity: 1/1 sessions active", says what to fix)
            self.env, self.broken = None, f"environment reset failed: {type(error).__name__}: {str(error)[:300]}"
        self.tools = environment_tools(self.env) if self.env is not None else {}
        # the inline format's one tool: a mixture member's own (members may differ), else the toolset's
        self.default_tool = next(iter(self.tools), "") if toolset.members else toolset.default_tool

    def run(self, call: "Call") -> tuple[str, bool]:
        ts = self.toolset
        if self.broken:
            return f"error: {self.broken}", False
        if call.name == "<invalid>":
            return f"error: {str(call.arguments.get('error', 'invalid call'))[:120]}", False
        name = call.name or self.default_tool
        fn = self.tools.get(name)
        if fn is None:
            return f"error: unknown tool '{name[:40]}'; available: {', '.join(self.tools)}", False
        args = dict(call.arguments)
        if not call.name and "expression" in args:  # inline: the one string argument of the default tool
            param = _first_param(fn) or "expression"
            args = {param: args.pop("expression")}
        for value in args.values():
            if isinstance(value, str) and len(value) > ts.max_expression_chars:
                return f"error: argument longer than {ts.max_expression_chars} characters", False
        try:
            out = _run_with_timeout(fn, args, ts.timeout_s)
        except TimeoutError as error:
            self.broken = f"tool '{name}' timed out ({error}); the episode's environment is abandoned"
            return f"error: {self.broken}", False
        except EnvironmentLost as error:
            self.broken = f"environment lost: {str(error)[:200]}"
            return f"error: {self.broken}", False
        except Exception as error:  # noqa: BLE001 - a tool's failure is data for the policy, not a crash
            msg = str(error) if isinstance(error, ToolError) else f"{type(error).__name__}: {error}"
            return f"error: {msg[:120]}", False
        text = out if isinstance(out, str) else json.dumps(out, default=str)[: ts.max_result_chars]
        text = text[: ts.max_result_chars]
        if ts.format.name == "inline":  # the result must not close or open a call itself
            text = text.replace("<<", "< <").replace(">>", "> >")
        return text, not text.startswith("error")

    def close(self) -> None:
        """End the episode once it is judged: the environment's optional close() (a session, a process), once,
        within the tool timeout. A failure there changes nothing already scored."""
        env, self._open = (self.env if self._open else None), False
        close = getattr(env, "close", None)
        if callable(close):
            try:
                _run_with_timeout(close, {}, self.toolset.timeout_s)
            except Exception:  # noqa: BLE001 - the episode is over and scored; its teardown cannot change that
                pass


class Toolset:
    """The environment of one run and its call format: `episode(row)` starts one episode (one environment
    instance, reset with the row) whose `run(call)` returns (result text, ok).

    `names` (agent.tools) are plain functions wrapped as one stateless environment; `environment`
    (agent.environment) names an environment class instead; `env_kwargs` are its constructor's knobs."""

    def __init__(
        self,
        names: Optional[list[str]],
        fmt: str,
        *,
        max_calls: int,
        max_expression_chars: int,
        timeout_s: Optional[float],
        eos_token: str = "<|im_end|>",
        environment: Optional[str] = None,
        env_kwargs: Optional[dict] = None,
        env_class: Optional[type] = None,
    ):
        if environment and names:
            raise ValueError("agent.environment and agent.tools are both set: an environment brings its own tools")
        if not environment and not names:
            raise ValueError("agent.tools is empty: there is no tool to call")
        self.environment = environment or None
        self.env_kwargs = dict(env_kwargs or {})
        # a mixture (envs/mixture.py): one factory per member, as TRL's environment_factory dict; each row's
        # `environment` picks its episode's (factory_for)
        self.members = mixture.member_factories(self.env_kwargs.get("members"), fmt) if environment == MIXTURE else {}
        if self.members:
            env_class = None
        elif env_class is None:  # else `environment` is played elsewhere (its OpenEnv client class)
            env_class = get_environment(environment) if environment else functions_environment(list(names))
        self.env_class = env_class
        self.factory = self.members or functools.partial(self.env_class, **self.env_kwargs)
        probe = (next(iter(self.members.values())) if self.members else self.factory)()
        self.tools = environment_tools(probe)
        if not self.tools:
            raise ValueError(f"agent.environment: {type(probe).__name__} has no public tool methods")
        self.names = list(names) if names else list(self.tools)
        self.default_tool = next(iter(self.tools)) if not names else names[0].rpartition(":")[2]
        self.format = InlineFormat() if fmt == "inline" else ChatFormat(eos_token)
        if fmt == "inline" and len(self.tools) > 1:
            raise ValueError(
                f"agent.format 'inline' (<<arg=) drives one tool; {type(probe).__name__} has "
                f"{', '.join(self.tools)}: use agent.format 'chat'"
            )
        self.max_calls = max_calls
        self.max_expression_chars = max_expression_chars
        self.timeout_s = timeout_s
        self.max_result_chars = MAX_RESULT_CHARS
        # for callers without rows (the server, `run`): made at its first use, so that a toolset never holds an
        # environment session (an OpenEnv server's slot) it does not use
        self._stateless: Optional[Episode] = None

    def factory_for(self, row: Optional[dict]):
        """The factory of the environment a row's episode runs: a mixture member's (the row's `environment`).

        Args:
            row: the dataset row (None: no mixture).

        Returns:
            A zero-argument callable that builds the environment.
        """
        return mixture.member_factory(self.members, row) if self.members else self.factory

    def episode(self, row: Optional[dict] = None) -> Episode:
        """A fresh episode of this toolset's environment, reset with `row`.

        Args:
            row: the dataset row the environment is reset with (None: an empty reset).
        """
        return Episode(self, row)

    def chat_template_kwargs(self) -> dict:
        """Arguments for `apply_chat_template`: the chat format describes the tools in the prompt (as TRL's
        GRPOTrainer(environment_factory=...) renders them); the inline format needs nothing."""
        return {"tools": list(self.tools.values())} if self.format.name == "chat" else {}

    def run(self, call: Call) -> tuple[str, bool]:
        """A call in a row-less episode shared by all callers (stateless tools: the calculator).

        Returns:
            (result text, ok).
        """
        if self.members:
            raise ValueError("agent.environment 'mixture': an episode needs its row's 'environment' (use episode(row))")
        if self._stateless is None:
            self._stateless = Episode(self)
        return self._stateless.run(call)


def toolset_from_params(agent, eos_token: str = "<|im_end|>", env_params: Optional[dict] = None) -> Optional[Toolset]:
    """The Toolset that `agent.*` params describe, or None when there is no tool and no environment.
    `env_params` (params.environments) gives a built-in environment its runtime knobs (registry.environment_spec).

    Args:
        eos_token: the tokenizer's end-of-turn token (the chat format ends a call's turn with it).
        env_params: params.environments: each built-in environment's knobs.

    Returns:
        The Toolset, or None.
    """
    environment = agent.environment
    if not agent.tools and not environment:
        return None
    env_kwargs = environment_spec(environment, env_params).env
    env_class = None
    if getattr(agent, "environment_url", None):  # the episodes go over OpenEnv; the knobs go to the server
        from ..envs.openenv_client import environment_over_openenv

        env_class = environment_over_openenv(agent.environment_url, environment, env_kwargs, agent.tool_timeout_s)
        env_kwargs = {}
    return Toolset(
        list(agent.tools),
        agent.format,
        max_calls=agent.max_tool_calls,
        max_expression_chars=agent.max_expression_chars,
        timeout_s=agent.tool_timeout_s,
        eos_token=eos_token,
        environment=environment,
        env_kwargs=env_kwargs,
        env_class=env_class,
    )


# --------------------------------------------------------------------- traces in training data
_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def split_annotated(
    text: str, fmt: str = "inline", eos_token: str = "<|im_end|>", episode: Optional[Episode] = None
) -> list[tuple[str, bool]]:
    """A worked solution with GSM8K annotations -> segments (text, is_model_text), exactly as the tool
    loop produces them: the policy writes `<<48/2=`, the tool writes `24>>`.

    '48/2=<<48/2=24>>24 clips' -> [('48/2=<<48/2=', True), ('24>>', False), ('24 clips', True)].
    Without `episode` the tool is the calculator: its part is what the calculator returns for the
    expression (not the annotation's own text), and an annotation it cannot evaluate is dropped (the
    policy writes that step itself). With `episode` (an environment's demonstration, one fresh episode
    reset with the row) every annotation is a call of the environment's tool, replayed in order, and the
    result is what the environment answers at that point. For the chat format each call becomes a
    `<tool_call>` that ends the turn and a `<tool_response>` turn.

    Args:
        text: a demonstration with `<<expr=result>>` annotations.
        fmt: the call format, inline or chat.
        eos_token: the end-of-turn token (chat format).
        episode: an environment's episode reset with the row, or None for the calculator.

    Returns:
        (text, is_model_text) segments: model text, tool results.
    """
    segments: list[tuple[str, bool]] = []
    pos = 0
    call_format = InlineFormat() if fmt == "inline" else ChatFormat(eos_token)
    end_turn = eos_token if fmt == "chat" else ""
    pending = ""
    for match in _ANNOTATION.finditer(text):
        if episode is None:
            result, ok = call_tool(calculator, match.group(1))
            call = Call("calculator", {"expression": match.group(1)})
        else:
            result, ok = episode.run(Call("", {"expression": match.group(1)}))
            name = episode.default_tool
            param = _first_param(episode.tools.get(name)) if episode.tools.get(name) else None
            call, ok = Call(name, {param or "expression": match.group(1)}), True
        if not ok:  # an annotation the calculator cannot evaluate: the policy writes that step itself
            pending += text[pos : match.start()]
            pos = match.end()
            continue
        segments.append((pending + text[pos : match.start()] + call_format.render_call(call) + end_turn, True))
        segments.append((call_format.render_result(result), False))
        pending, pos = "", match.end()
    segments.append((pending + text[pos:], True))
    return segments
