"""A streamed event stays one SSE line whatever characters the generated text holds."""

from __future__ import annotations

import json

from httpx._decoders import LineDecoder

from replayserve.server.generation import _event
from replayserve.server.protocol import CompletionChoice, CompletionResponse

# Characters that str.splitlines (and so httpx's iter_lines) treats as line ends; JSON escapes only
# the ASCII control ones, so U+0085, U+2028 and U+2029 used to pass through raw (a CPU CI failure:
# a tiny random model streamed one and the client's json.loads got half an event).
LINE_BREAKS = "\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def test_event_with_line_break_characters_is_one_line_that_round_trips() -> None:
    text = f"a{LINE_BREAKS}é日👋"
    chunk = CompletionResponse(id="cmpl-1", created=0, model="tiny", choices=[CompletionChoice(index=0, text=text)])
    event = _event(chunk)
    decoder = LineDecoder()
    lines = [*decoder.decode(event), *decoder.flush()]
    assert lines[0].startswith("data: ") and all(line == "" for line in lines[1:])
    assert event.isascii() and event.endswith("\n\n")
    body = json.loads(lines[0][len("data: "):])
    assert body["choices"][0]["text"] == text
    assert body == chunk.model_dump(mode="json", exclude_none=True)
