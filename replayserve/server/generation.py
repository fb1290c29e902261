"""POST /v1/completions and /v1/chat/completions: a body becomes prompts and `SamplingParams`, is
submitted to the async engine, and its deltas become one JSON response or a stream of SSE chunks.

A client that goes away (a closed stream, or a dropped connection while a whole response is being
collected) has its completions aborted at the next step boundary.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from replayserve.chat import ChatTemplate, Message, encode_rendered
from replayserve.sampling_params import SamplingParams
from replayserve.server.async_engine import AsyncEngine, Delta, EngineError, Overloaded, RequestGroup
from replayserve.server.chat_output import ChatChoices
from replayserve.server.constraints import constrain
from replayserve.server.errors import ApiError, invalid_value
from replayserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    error_body,
)
from replayserve.server.tool_parsers import ToolCallParser
from replayserve.server.tools import tool_use
from replayserve.tokenizer import Tokenizer, check_unicode

# Seconds a client told 429 is asked to wait: about what a batch of short requests takes.
RETRY_AFTER_S = 1


@dataclass
class _Choice:
    """A choice's output so far."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # (token id, alternatives)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.num_tokens += len(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs += list(zip(delta.token_ids, delta.logprobs, strict=True))
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass(frozen=True)
class _Format:
    """How one endpoint shapes its answers: chunk(id, created, delta, text offset of the delta),
    whole(id, created, choices, usage), first(id, created, choice index): a stream's opening chunk."""

    id_prefix: str
    prompt_field: str  # what an error about the prompt names
    chunk_type: type[BaseModel]
    chunk: Callable[[str, int, Delta, int], BaseModel | None]
    whole: Callable[[str, int, list[_Choice], Usage], BaseModel]
    first: Callable[[str, int, int], BaseModel] | None = None


class Generation:
    """The routes' shared part: the async engine, the served model's name, its tokenizer and chat template."""

    def __init__(self, engine: AsyncEngine, model_name: str, tokenizer: Tokenizer | None,
                 chat_template: ChatTemplate, tool_call_parser: ToolCallParser | None = None,
                 reasoning_markers: tuple[str, str] | None = None) -> None:
        """tool_call_parser: the model's tool-call format (`--tool-call-parser`); reasoning_markers:
        its reasoning block's tags (`--reasoning-parser`): chat splits them out as
        reasoning_content, and a grammar waits until the block has closed."""
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self.reasoning_markers = reasoning_markers

    # -- routes ------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: HttpRequest) -> Response:
        self._check_request(body)
        prompts = await self._completion_prompts(body.prompt)
        try:
            params = body.sampling_params(body.max_tokens, body.logprobs)
        except ValueError as e:
            raise invalid_value(e, "prompt") from e
        params = await constrain(body, params)
        self._check_context(max(len(p) for p in prompts), body.max_tokens, "max_tokens", "prompt")
        k = body.logprobs or 0

        def chunk(rid: str, created: int, d: Delta, offset: int) -> BaseModel:
            lp = None if d.logprobs is None else self._completion_logprobs(d.token_ids, d.logprobs, k, offset)
            return CompletionResponse(id=rid, created=created, model=self.model_name, choices=[CompletionChoice(
                index=d.index, text=d.text, logprobs=lp, finish_reason=d.finish_reason, stop_reason=d.stop_reason)])

        def whole(rid: str, created: int, choices: list[_Choice], usage: Usage) -> BaseModel:
            return CompletionResponse(id=rid, created=created, model=self.model_name, usage=usage, choices=[
                CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                 logprobs=None if body.logprobs is None else self._completion_logprobs(
                                     [t for t, _ in c.logprobs], [lp for _, lp in c.logprobs], k, 0))
                for i, c in enumerate(choices)])

        return await self._respond(body, raw, prompts, params, _Format("cmpl", "prompt", CompletionResponse,
                                                                        chunk, whole))

    async def chat(self, body: ChatCompletionRequest, raw: HttpRequest) -> Response:
        self._check_request(body)
        if self.tokenizer is None:
            raise ApiError(400, "chat needs a tokenizer; the model directory has no tokenizer.json", "messages")
        use = tool_use(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_call_parser)
        tokenizer = self.tokenizer
        render = functools.partial(self.chat_template.render, _flatten_content(body.messages), True, use.tools,
                                   body.chat_template_kwargs)
        try:
            # off the event loop, as text prompts are: a long one must not stall other streams
            text, prompt = await asyncio.to_thread(lambda: (t := render(), encode_rendered(t, tokenizer)))
        except ValueError as e:
            field = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
            raise ApiError(400, str(e), field) from e
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
        room = self.engine.config.resolved_max_model_len - len(prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        if max_tokens is not None:
            self._check_context(len(prompt), max_tokens,
                                "max_tokens" if body.max_tokens is not None else "max_completion_tokens", "messages")
        k = body.top_logprobs or 0
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        try:
            params = body.sampling_params(max(1, room) if max_tokens is None else max_tokens,
                                          k if body.logprobs else None)
        except ValueError as e:
            raise invalid_value(e, "messages", {"logprobs": "top_logprobs"}) from e
        params = await constrain(body, params, self.reasoning_markers,
                                 forced=None if use.constraint is None else (use.constraint, "tools"))
        outputs = ChatChoices(use, self.tool_call_parser, self.reasoning_markers, text)

        def chunk(rid: str, created: int, d: Delta, offset: int) -> BaseModel | None:
            delta = outputs.delta(d.index, d.text, d.finish_reason is not None)
            if delta is None and d.logprobs is None and d.finish_reason is None:
                return None
            lp = None if d.logprobs is None else self._chat_logprobs(d.token_ids, d.logprobs, k)
            return ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[ChatChunkChoice(
                index=d.index, delta=delta or DeltaMessage(content=""), logprobs=lp,
                finish_reason=outputs.finish_reason(d.index, d.finish_reason), stop_reason=d.stop_reason)])

        def whole(rid: str, created: int, choices: list[_Choice], usage: Usage) -> BaseModel:
            return ChatCompletionResponse(id=rid, created=created, model=self.model_name, usage=usage, choices=[
                ChatChoice(index=i, message=outputs.message(i, c.text),
                           finish_reason=outputs.finish_reason(i, c.finish_reason), stop_reason=c.stop_reason,
                           logprobs=None if not body.logprobs else self._chat_logprobs(
                               [t for t, _ in c.logprobs], [lp for _, lp in c.logprobs], k))
                for i, c in enumerate(choices)])

        def first(rid: str, created: int, index: int) -> BaseModel:  # OpenAI opens each choice with its role
            return ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[
                ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])

        return await self._respond(body, raw, [prompt], params, _Format("chatcmpl", "messages", ChatCompletionChunk,
                                                                         chunk, whole, first))

    # -- shared --------------------------------------------------------------------------------
    async def _respond(self, body: CompletionRequest | ChatCompletionRequest, raw: HttpRequest,
                       prompts: list[list[int]], params: SamplingParams, fmt: _Format) -> Response:
        try:
            group = self.engine.submit(prompts, params)
        except Overloaded as e:
            raise ApiError(429, f"the server is busy: {e}; retry later", None, "rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except EngineError as e:
            raise ApiError(503, str(e), None, "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except ValueError as e:
            raise invalid_value(e, fmt.prompt_field) from e
        rid, created = f"{fmt.id_prefix}-{uuid.uuid4().hex}", int(time.time())
        num_prompt_tokens = sum(len(p) for p in prompts)
        if body.stream:
            events = self._stream(group, rid, created, num_prompt_tokens, body.include_usage, fmt)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            choices = await _unless_disconnected(raw, _collect(group))
        except EngineError as e:
            raise ApiError(500, str(e), None, "internal_server_error") from e
        finally:
            self.engine.close(group)
        if choices is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(fmt.whole(rid, created, choices, _usage(num_prompt_tokens, choices)).model_dump(
            exclude_none=True))

    async def _stream(self, group: RequestGroup, rid: str, created: int, num_prompt_tokens: int,
                      include_usage: bool, fmt: _Format) -> AsyncIterator[str]:
        """SSE events; a closed connection cancels this generator, and `finally` aborts the rest."""
        choices = [_Choice() for _ in group.completions]
        try:
            if fmt.first is not None:
                for index in range(len(choices)):
                    yield _event(fmt.first(rid, created, index))
            async for delta in group.deltas():
                offset = len(choices[delta.index].text)
                choices[delta.index].add(delta)
                if delta.text or delta.logprobs or delta.finish_reason:
                    event = fmt.chunk(rid, created, delta, offset)
                    if event is not None:  # chat holds back text that may open a tool call
                        yield _event(event)
            if include_usage:
                usage = _usage(num_prompt_tokens, choices)
                yield _event(fmt.chunk_type(id=rid, created=created, model=self.model_name, choices=[], usage=usage))
        except EngineError as e:  # the status line is sent: the error goes in the stream, as OpenAI does
            yield f"data: {json.dumps(error_body(str(e), 'internal_server_error'))}\n\n"
        finally:
            self.engine.close(group)
        yield "data: [DONE]\n\n"

    def _check_request(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """The model named: what both routes check before anything else."""
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", code="model_not_found")

    def _check_context(self, num_prompt_tokens: int, max_tokens: int, field: str, prompt_field: str) -> None:
        """A 400, as vLLM answers, when the prompt and max_tokens together exceed max_model_len; a
        prompt that leaves no room at all is the engine's error (about the prompt), not this one."""
        limit = self.engine.config.resolved_max_model_len
        if num_prompt_tokens < limit < num_prompt_tokens + max_tokens:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_field}, "
                           f"{max_tokens} in the completion). Reduce the length of the {prompt_field} or {field} "
                           f"(at most {limit - num_prompt_tokens} here).", field)

    async def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]  # type: ignore[arg-type]
        if isinstance(prompt[0], list):
            return [list(p) for p in prompt]  # type: ignore[union-attr]
        if self.tokenizer is None:
            raise ApiError(400, "text prompts need a tokenizer; the model directory has no tokenizer.json "
                           "(send token ids instead)", "prompt")
        for i, text in enumerate(prompt):
            try:
                check_unicode(text, "prompt" if len(prompt) == 1 else f"prompt[{i}]")  # type: ignore[arg-type]
            except ValueError as e:
                raise ApiError(400, str(e), "prompt") from e
        # On a worker thread: tokenizing a long prompt takes long enough to stall every stream on the loop.
        encode = self.tokenizer.encode
        return await asyncio.to_thread(lambda: [encode(p) for p in prompt])  # type: ignore[union-attr,arg-type]

    def _token_text(self, token_id: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], k: int,
                             offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token, alternatives in zip(token_ids, logprobs, strict=True):
            text = self._token_text(token)
            out.tokens.append(text)
            out.token_logprobs.append(alternatives[token])
            # The sampled token is among the alternatives even outside the top k (k + 1 entries), as
            # OpenAI and vLLM send it. Tokens of equal text share a key: the likeliest keeps it.
            top: dict[str, float] = {}
            entries = dict(_top(alternatives, k)) | {token: alternatives[token]}
            for t, lp in sorted(entries.items(), key=lambda item: -item[1]):
                top.setdefault(self._token_text(t), lp)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> ChatLogprobs:
        def top(token: int, lp: float) -> TopLogprob:
            text = self._token_text(token)
            return TopLogprob(token=text, logprob=lp, bytes=list(text.encode()))

        content = []
        for token, alternatives in zip(token_ids, logprobs, strict=True):
            sampled = top(token, alternatives[token])
            content.append(TokenLogprob(**sampled.model_dump(), top_logprobs=[
                top(t, lp) for t, lp in _top(alternatives, k)]))
        return ChatLogprobs(content=content)


def _top(alternatives: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens; the engine's dict also holds the sampled token when it is not among them."""
    return sorted(alternatives.items(), key=lambda item: -item[1])[:k]


def _flatten_content(messages: list[Message]) -> list[Message]:
    """OpenAI lets content be a list of parts; text parts are joined, anything else is left for
    the message check to refuse."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            m = {**m, "content": "".join(p["text"] for p in content)}
        out.append(m)
    return out


async def _collect(group: RequestGroup) -> list[_Choice]:
    choices = [_Choice() for _ in group.completions]
    async for delta in group.deltas():
        choices[delta.index].add(delta)
    return choices


async def _unless_disconnected(raw: HttpRequest, work: object) -> list[_Choice] | None:
    """Runs ``work``; None if the client disconnects first (``work`` is cancelled). The body has
    been read, so the next ASGI message can only be the disconnect."""
    task = asyncio.ensure_future(work)  # type: ignore[arg-type]

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


def _usage(num_prompt_tokens: int, choices: list[_Choice]) -> Usage:
    completion = sum(c.num_tokens for c in choices)
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=completion,
                 total_tokens=num_prompt_tokens + completion)


def _event(model: BaseModel) -> str:
    """One SSE event. The JSON is ASCII (``json.dumps`` escapes non-ASCII): pydantic's own dump
    leaves U+2028, U+2029 and U+0085 raw, and clients that split lines the way ``str.splitlines``
    does (httpx's ``iter_lines``) cut such an event in two mid-string."""
    return f"data: {json.dumps(model.model_dump(mode='json', exclude_none=True), separators=(',', ':'))}\n\n"
