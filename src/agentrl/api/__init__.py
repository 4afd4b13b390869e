"""The agent-facing API: actions.py (run an experiment, compare, evaluate, ...), checks.py (every request checked
before anything runs), mcp_server.py (the same actions over MCP, `python -m agentrl.api.mcp_server`)."""
