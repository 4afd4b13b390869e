"""The policy's tool loop: loop.py generates with tool calls, tools.py turns agent.tools / agent.environment into
the tools an episode calls and parses the call formats, rewards.py scores completions (GRPO and eval)."""

# what `agentrl.agent` (the tool loop's module before issue 43) exported: now in agentrl.agent.loop
_LOOP_NAMES = frozenset(
    {"PRUNE_SHARE", "Rollout", "generate_with_tools", "sft_features", "tokenize_trace", "tool_stats"}
)


def __getattr__(name: str):
    """An old `from agentrl.agent import generate_with_tools` fails naming agentrl.agent.loop (an ImportError, which
    `from ... import` lets through, unlike an AttributeError whose message it replaces).

    Args:
        name: the attribute looked up on the package.

    Returns:
        Never: raises ImportError for a name of the loop, AttributeError for any other.
    """
    if name in _LOOP_NAMES:
        raise ImportError(f"agentrl.agent.{name} moved to agentrl.agent.loop: from agentrl.agent.loop import {name}")
    raise AttributeError(f"module 'agentrl.agent' has no attribute {name!r}")
