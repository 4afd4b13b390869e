"""The policy's tool loop: loop.py generates with tool calls, tools.py turns agent.tools / agent.environment into
the tools an episode calls and parses the call formats, rewards.py scores completions (GRPO and eval)."""
