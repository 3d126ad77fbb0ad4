"""The requests ``python -m edge.target`` decodes and the results it writes: the --prompt or the
--prompts JSONL (validated line by line), chats rendered by the target's chat template, JSONL
out."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.backends.base import VerifierBackend
from edge.target_config import TargetConfig
from starsd import protocol
from starsd.protocol import SamplingParams


@dataclass(frozen=True)
class Request:
    """One line of the input JSONL (or the single --prompt).

    A line may override the command line's sampling with "temperature", "top_k", "top_p" and
    "seed"; ``sampling`` is then set.
    """

    id: Any
    prompt: str
    max_new_tokens: int
    sampling: SamplingParams | None = None
    prompt_ids: tuple[int, ...] | None = None  # already tokenized (the HTTP server's chat)
    messages: tuple[dict[str, str], ...] | None = None  # a chat: rendered by the chat template


@dataclass(frozen=True)
class Result:
    """One line of the output JSONL."""

    id: Any
    prompt: str
    text: str
    token_ids: list[int]
    stats: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps(self.__dict__, ensure_ascii=False)


def load_requests(config: TargetConfig) -> list[Request]:
    """The --prompt or the --prompts JSONL as requests; ValueError names the line at fault."""
    if config.prompt is not None:
        return [
            Request(
                0, config.prompt, config.max_new_tokens, messages=_chat(config, None, config.prompt)
            )
        ]
    assert config.prompts is not None
    requests = []
    for line_no, line in enumerate(Path(config.prompts).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError("needs a string 'prompt'")
            max_new = _row_number(row, "max_new_tokens", config.max_new_tokens, int)
            sampling = _row_sampling(row, config, line_no - 1)
            messages = _chat(config, row.get("messages"), row["prompt"])
        except (ValueError, protocol.ProtocolError) as exc:
            reason = exc.message if isinstance(exc, protocol.ProtocolError) else exc
            raise ValueError(f"{config.prompts}:{line_no}: {reason}") from None
        requests.append(
            Request(row.get("id", line_no - 1), row["prompt"], max_new, sampling, messages=messages)
        )
    return requests


def _chat(config: TargetConfig, messages: Any, prompt: str) -> tuple[dict[str, str], ...] | None:
    """A line's conversation: its own "messages", else (--chat) its prompt as one user turn."""
    if messages is None:
        return ({"role": "user", "content": prompt},) if config.chat else None
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise ValueError("'messages' must be a list of {'role': str, 'content': str}")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def render_chats(backend: VerifierBackend, requests: list[Request]) -> list[Request]:
    """Requests with a conversation get their prompt ids from the target's chat template;
    ValueError where the model has none (or the template refuses the conversation)."""
    render = getattr(backend, "chat_prompt_ids", None)  # a backend may have none
    if render is None and any(r.messages is not None for r in requests):
        raise ValueError(f"backend {type(backend).__name__} cannot render a chat")
    return [
        r
        if r.messages is None
        else dataclasses.replace(r, prompt_ids=tuple(render(list(r.messages))))  # type: ignore[misc]
        for r in requests
    ]


def _row_sampling(row: dict[str, Any], config: TargetConfig, index: int) -> SamplingParams | None:
    """The line's own sampling, validated (ProtocolError names the field and its valid range)."""
    if not {"temperature", "top_k", "top_p", "seed"} & set(row):
        return None
    params = SamplingParams(
        _row_number(row, "temperature", config.temperature, float),
        _row_number(row, "top_k", config.top_k, int),
        _row_number(row, "top_p", config.top_p, float),
        _row_number(row, "seed", config.seed + index, int),
    )
    params.validate()
    return params


def _row_number(row: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    """``row[key]`` (or ``default``) as a ``kind``: a JSON number, integral where ``kind`` is int
    (50.0 is 50); ValueError otherwise (never a TypeError or OverflowError from a null, a string
    or a 1e400)."""
    value = row.get(key, default)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or (kind is int and isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{key} {value!r} is not {'an integer' if kind is int else 'a number'}")
    try:
        return kind(value)
    except OverflowError:
        raise ValueError(f"{key} {value!r} is out of range") from None


def write_results(config: TargetConfig, results: list[Result]) -> None:
    """JSONL to --out; a single --prompt without --out prints just its text."""
    if config.out:
        Path(config.out).write_text("".join(r.to_json() + "\n" for r in results))
    elif config.prompt is not None:
        print(results[0].text)
    else:
        sys.stdout.write("".join(r.to_json() + "\n" for r in results))
