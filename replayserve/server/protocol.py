"""The OpenAI wire format: request bodies (validated strictly: wrong types and unknown fields are
refused, naming the field) and the responses and stream chunks the routes send."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from replayserve.sampling_params import SamplingParams

# OpenAI's documented limits on the alternatives returned per token (the offline API allows up to
# the vocabulary): completions' legacy `logprobs` and chat's `top_logprobs`.
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20


class _Request(BaseModel):
    # strict: "5" is not an int, 1 is not a bool; forbid: a field we do not support (logit_bias,
    # tools, echo, ...) is an error the client sees, not something silently ignored.
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    """`{"type": "text"}` (the default), `{"type": "json_object"}` or `{"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}`; the fields past `type` are read by
    `server/constraints.py`, which names what is wrong in them."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str


class _GenerationRequest(_Request):
    """The fields completions and chat share. Sampling values are checked by `SamplingParams`,
    the one place their ranges are defined."""

    model: str | None = None  # None: the served model
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    user: str | None = None  # accepted for compatibility; not used
    response_format: ResponseFormat | None = None
    # vLLM's extra fields for a constraint (`server/constraints.py`): one of them, or response_format.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming `SamplingParams.<field>` for a value out of range."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
            max_tokens=max_tokens, stop=self.stop or (), n=self.n, ignore_eos=self.ignore_eos, logprobs=logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. prompt: a string, a list of strings, token ids or a list of them;
    each prompt gets n choices. logprobs: the top-k log-probabilities of each token, k at most
    `MAX_COMPLETION_LOGPROBS`, and the sampled token's (0: only the sampled token's)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = Field(default=None, le=MAX_COMPLETION_LOGPROBS)


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions. max_tokens (or max_completion_tokens) left out: up to the
    model's context length. top_logprobs: at most `MAX_TOP_LOGPROBS`."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, le=MAX_TOP_LOGPROBS)
    # Tool calling (`server/tools.py` checks them) and the template's extra variables.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions format: per token its text, log-probability, top alternatives
    ({text: log-probability}) and where its text starts in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """A whole response, and (object "text_completion" too, as OpenAI does) a stream chunk."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of the tool call at `index` of the message: the first names it (id, name)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction

    def model_post_init(self, context: Any) -> None:
        if self.id is not None and self.type is None:
            self.type = "function"


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "replayserve"
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
