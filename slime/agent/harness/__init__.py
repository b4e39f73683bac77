"""Coding-agent CLIs run in a sandbox (Claude Code, Codex, ...), each pointed at an adapter."""

from __future__ import annotations

from .claude_code import ClaudeCodeHarness
from .codex import CodexHarness
from .common import BaseHarness, HarnessContext

__all__ = ["BaseHarness", "HarnessContext", "ClaudeCodeHarness", "CodexHarness"]
