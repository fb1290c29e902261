"""Reasoning output, chosen by `--reasoning-parser` (`deepseek_r1` or `qwen3`, vLLM's names: both
read `<think>...</think>` blocks the same way): a chat choice's text before `</think>` is its
`reasoning_content`, the rest its content.

The output begins inside the block when the prompt opened it (its last `<think>` is not closed:
DeepSeek-R1's template, Qwen3's thinking templates) or when the output itself begins with
`<think>` (dropped, as vLLM drops it); otherwise it is all content (Qwen3 with
`enable_thinking: false`, whose template writes an empty closed block). A block never closed
leaves everything reasoning. Streamed, a part of a tag that may be forming is held back.
"""

from __future__ import annotations

from replayserve.server.tags import forming
from replayserve.structured.request_grammar import reasoning_state

THINK = ("<think>", "</think>")
REASONING_PARSERS = {"deepseek_r1": THINK, "qwen3": THINK}


class ReasoningSplitter:
    """One choice's text split into (reasoning, content) pieces as it arrives."""

    def __init__(self, markers: tuple[str, str], prompt_text: str) -> None:
        self.start, self.end = markers
        # "maybe": the output may open the block; "reasoning": inside it; "content": after it or without one.
        self.state = "reasoning" if reasoning_state(prompt_text, *markers) == "open" else "maybe"
        self.at_start = True  # the output may still begin with the opening tag
        self.held = ""

    def add(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that may go out once ``text`` follows."""
        self.held += text
        if self.at_start:
            stripped = self.held.lstrip()
            if stripped.startswith(self.start):
                self.held, self.state, self.at_start = stripped[len(self.start) :], "reasoning", False
            elif self.start.startswith(stripped):
                return "", ""  # the opening tag may be forming (or only whitespace so far)
            else:
                self.at_start = False
                self.state = "content" if self.state == "maybe" else self.state
        reasoning = ""
        if self.state == "reasoning":
            at = self.held.find(self.end)
            if at < 0:
                cut = len(self.held) - forming(self.held, self.end)
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
            reasoning, self.held, self.state = self.held[:at], self.held[at + len(self.end) :], "content"
        content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The rest, once the output has ended."""
        rest, self.held = self.held, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)
