"""Environments: stateful, multi-turn episodes in the shape of TRL's `environment_factory` (issue 29)."""

from __future__ import annotations

from typing import Optional


def row_text(row: dict) -> Optional[str]:
    """The task's text in a row: `question`, else the last message of `prompt` (what the server has)."""
    if isinstance(row.get("question"), str):
        return row["question"]
    prompt = row.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        content = prompt[-1].get("content")
        return content if isinstance(content, str) else None
    return None
