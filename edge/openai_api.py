"""The OpenAI API's request and response shapes as ``edge.serve`` speaks them.

Requests are pydantic models in strict mode (a string where a number belongs is refused, never
coerced); every refusal is an :class:`ApiError` that the server turns into OpenAI's error body
``{"error": {"message", "type", "param", "code"}}`` naming the field at fault. Sampling ranges
are checked by ``protocol.SamplingParams.validate``, the one validator the hub and the command
line use too. Responses are plain dicts in OpenAI's shapes, plus an extra ``starsd`` field with the
request's speculation figures (rounds, accepted, mean_accepted, ...).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from starsd import protocol
from starsd.protocol import SamplingParams

MAX_STOPS = 4  # as OpenAI: at most four stop strings
MAX_TOKENS_NO_LIMIT = 1 << 16  # the cap on max_tokens for a model that names no context length
# Fields OpenAI defines that this server does not implement: refused unless given their neutral
# value, so a client never silently gets something other than what it asked for.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
_NESTED = {"role", "content", "text", "type", "include_usage"}


class ApiError(Exception):
    """A request refused with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = {
            401: "authentication_error",
            404: "not_found_error",
            429: "rate_limit_error",
            500: "server_error",
            503: "server_error",
        }.get(self.status, "invalid_request_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # e.g. "name"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class BaseRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(strict=True, extra="allow")  # e.g. "user": accepted, unused
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension (vLLM has it too)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(BaseRequest):
    prompt: str | list[int] | list[str] | list[list[int]]


class ChatRequest(BaseRequest):
    messages: list[Message]


@dataclass(frozen=True)
class Defaults:
    """The server's defaults for what a request leaves out (its command line)."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float


R = TypeVar("R", bound="BaseRequest")


def parse(kind: type[R], body: Any) -> R:
    """``body`` (decoded JSON) as a ``kind`` request; ApiError 400 naming the field if not."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    where = _unencodable(body)
    if where is not None:  # JSON allows lone surrogates ("\ud800"); no tokenizer takes them
        raise ApiError(
            400, f"{where}: the text is not valid Unicode (a lone surrogate)", where, "invalid_text"
        )
    try:
        request = kind.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(first["loc"])
        raise ApiError(
            400,
            f"{param}: {first['msg']}" if param else first["msg"],
            param,
            "invalid_type" if first["type"].endswith("_type") else None,
        ) from None
    for name, neutral in UNSUPPORTED.items():
        value = (request.model_extra or {}).get(name)
        if not any(value == ok for ok in neutral):
            raise ApiError(400, f"{name} is not supported by this server", name, "unsupported")
    return request


def _unencodable(value: Any, path: str = "") -> str | None:
    """The path of the first string in ``value`` (decoded JSON) that UTF-8 cannot encode, or
    None; keys count as strings too."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        here = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        found = _unencodable(key, here) if isinstance(key, str) else None
        found = found or _unencodable(item, here)
        if found is not None:
            return found
    return None


def _param(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a field path: ``messages[0].role``, ``stop`` (union member
    names such as ``list[str]`` left out)."""
    path = str(loc[0]) if loc else ""
    for part in loc[1:]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _NESTED:
            path += f".{part}"
    return path


def sampling(request: BaseRequest, defaults: Defaults, fallback_seed: int | None) -> SamplingParams:
    """The request's sampling, validated; ApiError 400 naming the field and its valid range."""
    if request.n != 1:
        raise ApiError(400, f"n {request.n} is not supported: only n = 1", "n", "unsupported")
    params = SamplingParams(
        defaults.temperature if request.temperature is None else request.temperature,
        defaults.top_k if request.top_k is None else request.top_k,
        defaults.top_p if request.top_p is None else request.top_p,
        fallback_seed if request.seed is None else request.seed,
    )
    try:
        params.validate()
    except protocol.ProtocolError as exc:
        raise ApiError(400, exc.message, exc.message.split(" ")[0], "invalid_value") from None
    return params


def stops(request: BaseRequest) -> tuple[str, ...]:
    """The request's stop strings (at most four, none empty)."""
    found = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(found) > MAX_STOPS or not all(found):
        raise ApiError(400, f"stop must be at most {MAX_STOPS} non-empty strings", "stop")
    return tuple(found)


def max_tokens(request: BaseRequest, default: int, prompt_tokens: int, limit: int | None) -> int:
    """Tokens to generate: asked for (max_completion_tokens or max_tokens) or the server's
    default, within what the context leaves after the prompt (ApiError 400 past it)."""
    asked = request.max_completion_tokens
    name = "max_completion_tokens"
    if asked is None:
        asked, name = request.max_tokens, "max_tokens"
    room = MAX_TOKENS_NO_LIMIT if limit is None else limit - prompt_tokens
    if room < 1:
        raise ApiError(
            400,
            f"the prompt has {prompt_tokens} tokens; this model's context is {limit}",
            "prompt",
            "context_length_exceeded",
        )
    if asked is None:
        return min(default, room)
    if not 1 <= asked <= room:
        why = (
            f"the context is {limit} tokens and the prompt {prompt_tokens}"
            if limit
            else "this server's cap"
        )
        raise ApiError(400, f"{name} {asked} is out of range: must be in [1, {room}] ({why})", name)
    return asked


def completion_prompt(request: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text or token ids (several: refused)."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, "only one prompt per request is supported", "prompt")
        prompt = prompt[0]  # type: ignore[assignment]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", "prompt")
    return prompt  # type: ignore[return-value]


# ---------------------------------------------------------------------- responses


@dataclass
class Reply:
    """What a response says about one request; ``chat`` picks the shapes."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        kind += ".chunk" if chunk and self.chat else ""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def full(
        self, text: str, finish: str, usage: dict[str, int], figures: dict[str, Any]
    ) -> dict[str, Any]:
        """The non-streamed response."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head(False), "choices": [choice], "usage": usage, "starsd": figures}

    def chunk(
        self, text: str | None, finish: str | None = None, figures: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One streamed chunk; ``text`` None is the chat stream's opening (the role)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if not self.chat:
            choice["text"] = text or ""
        elif text is None:
            choice["delta"] = {"role": "assistant", "content": ""}
        else:
            choice["delta"] = {"content": text} if text or finish is None else {}
        out = {**self._head(True), "choices": [choice]}
        if figures is not None:
            out["starsd"] = figures
        return out

    def usage_chunk(self, usage: dict[str, int], figures: dict[str, Any]) -> dict[str, Any]:
        """The last chunk under ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage, "starsd": figures}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
