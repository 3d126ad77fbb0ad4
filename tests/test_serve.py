"""edge.serve in process on random loopback ports: the OpenAI API (through the real ``openai``
client and raw HTTP), bad input, overload, disconnects, and both /metrics endpoints.

Greedy output through the server must be the target alone's (transformers ``generate`` in
float32, then decoded), streamed or not, with the hub or without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import re
import shutil
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from procs import free_port, reference
from prometheus_client.parser import text_string_to_metric_families

from edge import serve
from edge.backends.torch import TorchBackend
from edge.target import TargetConfig, job_sequence, parse_args
from starsd import models
from starsd.hub import metrics as hub_metrics

PROMPTS = ["To be, or not to be", "Now is the winter of", "All the world"]
N = 24
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@contextlib.asynccontextmanager
async def _serving(target: models.LoadedModel, **options: object) -> AsyncIterator[serve.Serving]:
    settings = {
        "model": "unused",
        "port": 0,
        "max_new_tokens": N,
        "standalone": True,
        "deadline_ms": 5000.0,
        **options,
    }
    config = TargetConfig(**settings)  # type: ignore[arg-type]
    backend = TorchBackend(target)
    factory = functools.partial(job_sequence, backend, config)
    async with serve.serving(config, backend, factory) as running:
        yield running


def _client(running: serve.Serving, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key=key, max_retries=0)


def _expected(target_dir: Path, target: models.LoadedModel, prompt: str) -> tuple[str, int]:
    ids = reference(target_dir, prompt, N)
    return models.decode_ids(target, ids), len(ids)


@pytest.fixture(scope="module")
def chat_target(
    llama_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, models.LoadedModel]:
    """The tiny target with a chat template, loaded through the real loading code."""
    path = tmp_path_factory.mktemp("chat") / "llama-chat"
    shutil.copytree(llama_pair[0], path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path, models.load_causal_lm(path)


async def test_openai_client_greedy_completions_equal_the_target_alone_through_the_hub(
    running_hub, llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    """Bugs caught: a token lost, doubled or reordered between a round's commit and the
    response; usage miscounted; a stream that joins to other text than the response.
    Through the hub (rounds verified), with the openai client, streamed and not."""
    async with _serving(
        llama_target, standalone=False, hub=running_hub.endpoint, concurrency=2
    ) as running:
        client = _client(running)
        for prompt in PROMPTS[:2]:
            text, n = _expected(llama_pair[0], llama_target, prompt)
            full = await client.completions.create(
                model="llama-target", prompt=prompt, max_tokens=N, temperature=0
            )
            assert full.choices[0].text == text
            prompt_tokens = len(models.encode_text(llama_target, prompt))
            assert full.usage is not None
            assert (
                full.usage.prompt_tokens,
                full.usage.completion_tokens,
                full.usage.total_tokens,
            ) == (prompt_tokens, n, prompt_tokens + n)
            assert full.choices[0].finish_reason == ("length" if n == N else "stop")
            figures = full.model_extra["starsd"]  # type: ignore[index]
            assert figures["rounds"] > 0, "the hub never proposed: nothing speculative tested"
            stream = await client.completions.create(
                model="llama-target",
                prompt=prompt,
                max_tokens=N,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == text
            assert chunks[-1].usage == full.usage and not chunks[-1].choices
            assert len([c for c in chunks if c.choices]) > 2, "not streamed as tokens commit"


async def test_with_the_hub_down_requests_still_complete_exactly(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    """Bug caught: a server that fails (or hangs) its requests while no hub answers."""
    dead = f"tcp://127.0.0.1:{free_port()}"
    prompt = PROMPTS[1]
    text, n = _expected(llama_pair[0], llama_target, prompt)
    async with (
        _serving(llama_target, standalone=False, hub=dead) as running,
        httpx.AsyncClient(timeout=60) as h,
    ):
        health = (await h.get(f"{running.url}/health")).json()
        assert health == {"status": "ok", "hub": False, "hubs": {dead: False}}
        r = await h.post(
            f"{running.url}/v1/completions",
            json={"model": "llama-target", "prompt": prompt, "max_tokens": N},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
        assert r.json()["usage"]["completion_tokens"] == n
        assert r.json()["starsd"]["rounds"] == 0


async def test_serve_with_a_dead_and_a_live_hub_speculates_on_the_live_one(
    running_hub, llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    """Bugs caught: --serve that takes only the first of several hubs, or that waits on (or
    decodes alone because of) the unreachable one."""
    dead = f"tcp://127.0.0.1:{free_port()}"
    prompt = PROMPTS[0]
    text, _ = _expected(llama_pair[0], llama_target, prompt)
    hubs = f"{dead},{running_hub.endpoint}"
    async with (
        _serving(llama_target, standalone=False, hub=hubs) as running,
        httpx.AsyncClient(timeout=60) as h,
    ):
        health = (await h.get(f"{running.url}/health")).json()
        assert health["hubs"] == {dead: False, running_hub.endpoint: True}
        r = await h.post(
            f"{running.url}/v1/completions",
            json={"model": "llama-target", "prompt": prompt, "max_tokens": N},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
        assert r.json()["starsd"]["rounds"] > 0


async def test_chat_through_the_openai_client_streamed_and_not(
    chat_target: tuple[Path, models.LoadedModel],
) -> None:
    """Bugs caught: the chat template not applied (or a second BOS added), the chat stream's
    role/content/finish chunks malformed, a chat stream joining to other text."""
    _, target = chat_target
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = models.chat_prompt_ids(target, messages)
    assert ids.count(0) == 2, "the template's own BOS tokens, none added"
    prompt = torch.tensor([ids])  # the BOS is id 0: the mask must not read it as padding
    greedy = target.model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=N,
        pad_token_id=0,
        eos_token_id=sorted(target.eos_token_ids),
    )
    expected = models.decode_ids(target, greedy[0, len(ids) :].tolist())
    async with _serving(target) as running:
        client = _client(running)
        full = await client.chat.completions.create(
            model="llama-chat", messages=messages, max_completion_tokens=N
        )  # type: ignore[arg-type]
        assert full.choices[0].message.content == expected
        assert full.usage is not None and full.usage.prompt_tokens == len(ids)
        stream = await client.chat.completions.create(
            model="llama-chat", messages=messages, max_tokens=N, stream=True
        )  # type: ignore[arg-type]
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


async def test_chat_on_a_model_without_a_template_is_a_clear_400(
    llama_target: models.LoadedModel,
) -> None:
    """Bug caught: a chat request silently formatted some other way (or a 500)."""
    async with _serving(llama_target) as running:
        with pytest.raises(openai.BadRequestError) as info:
            await _client(running).chat.completions.create(
                model="llama-target", messages=[{"role": "user", "content": "Hi"}]
            )
        assert "no chat template" in str(info.value)


BAD = [  # (body, status, what the message names)
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": "llama-target", "prompt": 5}, 400, "prompt"),
    ({"model": "llama-target", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "llama-target", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "llama-target", "prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ({"model": "llama-target", "prompt": "x", "temperature": math.nan}, 400, "temperature"),
    ({"model": "llama-target", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "llama-target", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "llama-target", "prompt": "x", "stop": ["a"] * 5}, 400, "stop"),
    ({"model": "llama-target", "prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ({"model": "llama-target", "prompt": [999999]}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "gpt-4"),
    ({"model": "llama-target", "prompt": "x" * 5000}, 413, "bytes"),
]


async def test_bad_input_gets_a_4xx_naming_the_field_and_the_server_keeps_serving(
    llama_target: models.LoadedModel,
) -> None:
    """Bugs caught: a 500 or a traceback on malformed input, NaN accepted (json.loads takes it),
    a type coerced ("5" -> 5), an error body without a message, a server that stops after."""
    async with _serving(llama_target, max_body_bytes=4096) as running, httpx.AsyncClient() as h:
        url = f"{running.url}/v1/completions"
        for body, status, needle in BAD:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await h.post(url, content=content, headers={"content-type": "application/json"})
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert needle in error["message"] or needle == error["param"], (body, error)
        r = await h.post(url, json={"model": "llama-target", "prompt": "x", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


async def test_past_the_queue_bound_a_request_gets_429_with_retry_after(
    llama_target: models.LoadedModel,
) -> None:
    """Bug caught: an unbounded backlog (every request admitted, latency without limit)."""
    async with (
        _serving(llama_target, max_queue=1, concurrency=1) as running,
        httpx.AsyncClient(timeout=60) as h,
    ):
        url = f"{running.url}/v1/completions"
        body = {"model": "llama-target", "prompt": "To be", "max_tokens": 200, "stream": True}
        async with h.stream("POST", url, json=body) as first:
            assert first.status_code == 200
            r = await h.post(url, json={**body, "stream": False})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "too_many_requests"
        for _ in range(100):  # the first's slot is freed once its client went away
            if running.server.requests.admitted == 0:
                break
            await asyncio.sleep(0.05)
        r = await h.post(url, json={**body, "stream": False, "max_tokens": 2})
        assert r.status_code == 200


async def _hub_sessions(running_hub) -> int:
    with running_hub.hub.lock:
        return running_hub.hub.snapshot().sessions


async def test_a_client_that_disconnects_mid_stream_frees_its_hub_session(
    running_hub, llama_target: models.LoadedModel
) -> None:
    """Bug caught: a sequence decoded to the end for nobody, its hub session held meanwhile."""
    async with (
        _serving(llama_target, standalone=False, hub=running_hub.endpoint) as running,
        httpx.AsyncClient(timeout=60) as h,
    ):
        body = {"model": "llama-target", "prompt": "To be", "max_tokens": 220, "stream": True}
        async with h.stream("POST", f"{running.url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
            deadline = time.monotonic() + 10
            while await _hub_sessions(running_hub) == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert await _hub_sessions(running_hub) == 1
        deadline = time.monotonic() + 5
        while await _hub_sessions(running_hub) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await _hub_sessions(running_hub) == 0, _decoding(running)
        assert running.server.requests.admitted == 0
        families = _parse((await h.get(f"{running.url}/metrics")).text)
        reasons = {
            s.labels["finished_reason"]: s.value
            for s in families["starsd:request_success"]
            if s.name.endswith("_total")
        }
        assert reasons == {"abort": 1}, "decoded to the end regardless"


def _decoding(running: serve.Serving) -> str:
    """What the server is still decoding, and where each decoding task waits (for a failure's
    message)."""
    lines = []
    for g in running.server.requests.live:
        done = g.seq.done if g.seq is not None else None
        lines.append(f"cancelled={g.cancelled} answered={g.answered} seq.done={done}")
        if g.task is not None:
            lines += [repr(frame) for frame in g.task.get_stack()]
    return "\n".join(lines) or "nothing in flight"


async def test_a_stream_that_ends_stops_its_decoding_on_the_event_loop(
    llama_target: models.LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug caught: a stream's cancel run in Starlette's thread pool, where cancelling an
    asyncio task is not thread-safe (its wakeup can wait for an unrelated event)."""
    threads: list[int] = []
    cancel = serve.Generation.cancel

    def recording(generation: serve.Generation) -> None:
        threads.append(threading.get_ident())
        cancel(generation)

    monkeypatch.setattr(serve.Generation, "cancel", recording)
    async with _serving(llama_target) as running, httpx.AsyncClient(timeout=60) as h:
        body = {"model": "llama-target", "prompt": "To be", "max_tokens": 4, "stream": True}
        async with h.stream("POST", f"{running.url}/v1/completions", json=body) as r:
            assert [line async for line in r.aiter_lines() if line][-1] == "data: [DONE]"
        deadline = time.monotonic() + 5
        while not threads and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    assert threads and set(threads) == {threading.get_ident()}, threads


def _parse(text: str) -> dict[str, list]:
    """Samples by family name (a counter's family drops the _total suffix)."""
    return {f.name: f.samples for f in text_string_to_metric_families(text) if f.samples}


def _value(families: dict[str, list], sample: str, **labels: str) -> float:
    family = sample.removesuffix("_total").removesuffix("_sum").removesuffix("_count")
    return sum(
        s.value for s in families[family] if s.name == sample and labels.items() <= s.labels.items()
    )


async def test_both_metrics_endpoints_parse_and_agree_with_per_request_figures(
    running_hub, llama_target: models.LoadedModel
) -> None:
    """Bugs caught: a round counted twice or lost between the worker thread and /metrics;
    exposition prometheus_client cannot parse; hub counters that disagree with its STATS."""
    exporter = hub_metrics.serve_metrics(running_hub.hub, "127.0.0.1", 0)
    try:
        async with _serving(
            llama_target, standalone=False, hub=running_hub.endpoint, concurrency=3
        ) as running:
            client = _client(running)
            replies = await asyncio.gather(
                *(
                    client.completions.create(
                        model="llama-target", prompt=p, max_tokens=N, temperature=0
                    )
                    for p in PROMPTS
                )
            )
            figures = [r.model_extra["starsd"] for r in replies]  # type: ignore[index]
            async with httpx.AsyncClient() as h:
                target = _parse((await h.get(f"{running.url}/metrics")).text)
                hub = _parse((await h.get(f"http://127.0.0.1:{exporter.port}/metrics")).text)
    finally:
        exporter.close()
    for name, key in (
        ("num_drafts", "rounds"),
        ("num_draft_tokens", "proposed"),
        ("num_accepted_tokens", "accepted"),
    ):
        assert _value(target, f"starsd:spec_decode_{name}_total") == sum(f[key] for f in figures)
    accepted = sum(f["accepted"] for f in figures)
    assert accepted > 0
    assert _value(target, "starsd:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    tokens = sum(r.usage.completion_tokens for r in replies)  # type: ignore[union-attr]
    assert _value(target, "starsd:generation_tokens_total") == tokens
    assert _value(target, "starsd:time_to_first_token_seconds_count") == len(PROMPTS)
    assert _value(target, "starsd:e2e_request_latency_seconds_count") == len(PROMPTS)
    assert _value(target, "starsd:num_requests_running") == 0
    with running_hub.hub.lock:
        stats = running_hub.hub.snapshot()
    assert _value(hub, "starsd:spec_decode_num_accepted_tokens_total") == stats.accepted
    assert _value(hub, "starsd:spec_decode_num_draft_tokens_total") == stats.proposed
    assert 0 < stats.accepted <= accepted  # a sequence's last round has no verdict
    assert _value(hub, "starsd:hub_sessions_opened_total") >= len(PROMPTS)
    assert _value(hub, "starsd:hub_batch_size_count") == stats.batches
    assert _value(hub, "starsd:hub_jobs_total") == stats.jobs
    targets = {s.labels["target"] for s in hub["starsd:hub_proposals"]}
    assert len(targets) == 1 and targets.pop().startswith("t-"), "a bounded label, not an id"


async def test_an_api_key_is_required_when_set(llama_target: models.LoadedModel) -> None:
    """Bug caught: the key not checked (or checked on /v1/models only)."""
    async with _serving(llama_target, api_key="sesame") as running:
        with pytest.raises(openai.AuthenticationError):
            await _client(running, "wrong").completions.create(model="llama-target", prompt="x")
        reply = await _client(running, "sesame").completions.create(
            model="llama-target", prompt="x", max_tokens=2
        )
        assert reply.usage is not None and reply.usage.completion_tokens <= 2
        async with httpx.AsyncClient() as h:
            assert (await h.get(f"{running.url}/health")).status_code == 200


def test_listening_beyond_loopback_without_a_key_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Bug caught: an open, unauthenticated model server on the network by a typo."""
    with pytest.raises(SystemExit):
        parse_args(["--serve", "--host", "0.0.0.0"])
    assert "--api-key" in capsys.readouterr().err
    assert parse_args(["--serve", "--host", "0.0.0.0", "--api-key", "k"]).serve


async def test_a_stop_string_ends_the_text_before_it_streamed_and_not(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    """Bugs caught: the stop string (or text past it) returned, finish_reason "length", the
    sequence decoded on after the stop, a request counted both as answered and aborted."""
    # The tiny random model writes bytes that are not all UTF-8: a stop string of plain ASCII
    # letters, after some text (U+FFFD is no character to stop at).
    prompt = PROMPTS[0]
    text, _ = _expected(llama_pair[0], llama_target, prompt)
    found = re.search(r"[A-Za-z]{2}", text[2:])
    assert found, f"pick another prompt: {text!r}"
    stop = found.group(0)
    before = text[: text.index(stop)]
    async with _serving(llama_target) as running:
        client = _client(running)
        full = await client.completions.create(
            model="llama-target", prompt=prompt, max_tokens=N, stop=[stop, "\x00never"]
        )
        assert (full.choices[0].text, full.choices[0].finish_reason) == (before, "stop")
        stream = await client.completions.create(
            model="llama-target", prompt=prompt, max_tokens=N, stop=stop, stream=True
        )
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks) == before
        assert chunks[-1].choices[0].finish_reason == "stop"
        async with httpx.AsyncClient() as h:
            families = _parse((await h.get(f"{running.url}/metrics")).text)
    reasons = {
        s.labels["finished_reason"]: s.value
        for s in families["starsd:request_success"]
        if s.name.endswith("_total")
    }
    assert reasons == {"stop": 2}
