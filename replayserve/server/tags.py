"""Tags in streamed text (`<tool_call>`, `</think>`): how much of a text's end may be a tag forming."""

from __future__ import annotations


def forming(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (0: none): held back while
    streaming, since the next piece may complete the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
