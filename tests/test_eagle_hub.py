"""The EAGLE backend on the hub: lossless greedy and sampling, features checked at the boundary."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PROMPT
from procs import HubProcess, TargetProcess, reference, write_prompts
from scipy import stats
from test_eagle import eagle_state, write_head

from edge.verifier import TargetSequence
from starsd import hub as hub_module
from starsd import models, protocol, sampling
from starsd.hub.drafters.base import DraftJob
from starsd.protocol import Draft, Error, ErrorCode, Hello, Open, Opened, SamplingParams, Welcome


@pytest.fixture(scope="module")
def head_dir(llama_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    target_dir = llama_pair[0]
    return write_head(tmp_path_factory.mktemp("eagle-hub"), target_dir, eagle_state(target_dir))


@pytest.fixture(scope="module")
def eagle_hub(llama_pair: tuple[Path, Path], head_dir: Path) -> hub_module.Hub:
    config = hub_module.HubConfig(model=str(head_dir), draft_kind="eagle",
                                  target=str(llama_pair[0]))  # fmt: skip
    return hub_module.build_hub(config)


def _hello(target: models.LoadedModel, width: int) -> list:
    return protocol.encode(Hello("t", target.vocab_size, target.tokenizer_fingerprint,
                                 feature_width=width))  # fmt: skip


def test_hello_without_features_is_refused_at_once(
    eagle_hub: hub_module.Hub, llama_target: models.LoadedModel
) -> None:
    (refused,) = eagle_hub.handle(b"plain", _hello(llama_target, 0))
    assert isinstance(refused, Error) and refused.code == ErrorCode.INCOMPATIBLE
    assert "needs target features of width 64" in refused.message
    (welcome,) = eagle_hub.handle(b"eagle", _hello(llama_target, 64))
    assert isinstance(welcome, Welcome) and welcome.feature_width == 64
    assert welcome.draft_kind == "eagle" and welcome.feature_dtype == "float16"


@pytest.mark.parametrize("case", ["missing", "wide", "float32", "rows", "nan"])
def test_bad_features_get_an_error_and_change_nothing(
    eagle_hub: hub_module.Hub, llama_target: models.LoadedModel, case: str
) -> None:
    eagle_hub.handle(b"eagle", _hello(llama_target, 64))
    good = np.zeros((len(PROMPT) - 1, 64), dtype=np.float16)
    bad = {"missing": None, "wide": np.zeros((3, 65), np.float16), "rows": good[:1],
           "float32": good.astype(np.float32), "nan": np.full_like(good, np.nan)}[case]  # fmt: skip
    sessions = dict(eagle_hub.sessions)
    (reply,) = eagle_hub.handle(b"eagle", protocol.encode(
        Open(1, PROMPT, SamplingParams(), 4, bad)))  # fmt: skip
    assert isinstance(reply, Error) and reply.code == ErrorCode.INVALID_ARGUMENT, reply
    assert eagle_hub.sessions == sessions
    (opened,) = eagle_hub.handle(b"eagle", protocol.encode(
        Open(2, PROMPT, SamplingParams(), 4, good)))  # fmt: skip
    assert isinstance(opened, Opened)
    session = eagle_hub.sessions[opened.tag]
    session.in_flight = False  # no drafting thread here: pretend proposal 0 went out
    session.next_seq, session.last_gamma = 1, 4
    draft = Draft(opened.tag, 1, 2, np.array([7], np.int32), None if case == "missing" else bad)
    (reply,) = eagle_hub.handle(b"eagle", protocol.encode(draft))
    assert isinstance(reply, Error) and reply.code == ErrorCode.INVALID_ARGUMENT
    assert session.next_seq == 1 and not session.in_flight and session.state.tokens == list(PROMPT)


def _eagle_rounds(hub: hub_module.Hub, seq: TargetSequence, gamma: int) -> None:
    """Speculate in process with the hub's EAGLE proposer, exactly as over the wire."""
    state = hub.proposer.new_state(list(seq.prompt), seq.params, gamma)
    job = DraftJob(b"t", 0, state, 0, (), features=seq.features(0, len(seq.prompt) - 1))
    while not seq.done:
        (proposal,) = hub.proposer.propose([job])
        assert not isinstance(proposal, Error), proposal
        synced = seq.committed
        q = None
        if not seq.params.greedy and len(proposal.tokens):
            support = None if proposal.q_support is None else torch.from_numpy(
                proposal.q_support.astype(np.int64))  # fmt: skip
            q = sampling.dense_q(torch.from_numpy(proposal.q_probs), support,
                                 seq.target.vocab_size)  # fmt: skip
        accepted, appended = seq.verify([int(t) for t in proposal.tokens], q)
        job = DraftJob(b"t", job.seq + 1, state, accepted, tuple(appended),
                       features=seq.features(synced - 1, seq.committed - 1))  # fmt: skip


def test_in_process_greedy_equals_target_alone(
    eagle_hub: hub_module.Hub, llama_pair: tuple[Path, Path]
) -> None:
    target = models.load_causal_lm(llama_pair[0])
    for prompt in ([5, 17, 33, 8], [9], list(range(40, 70))):
        seq = TargetSequence(target, prompt, SamplingParams(), 40, collect_features=True)
        _eagle_rounds(eagle_hub, seq, 4)
        ids = torch.tensor([prompt])
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=40, eos_token_id=sorted(target.eos_token_ids),
                                    pad_token_id=0)  # fmt: skip
        assert seq.generated == out[0, len(prompt) :].tolist(), prompt
        assert seq.stats.rounds > 0


def test_sampling_through_eagle_matches_the_target_distribution(
    eagle_hub: hub_module.Hub, llama_target: models.LoadedModel
) -> None:
    """Chi-square on the joint law of the first two tokens (top-k 3: 9 cells), 3000 trials."""
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = [5, 17, 33, 8]
    expected = _two_token_law(llama_target, prompt, params)
    counts: dict[tuple[int, int], int] = {}
    for trial in range(3000):
        seq = TargetSequence(llama_target, prompt, SamplingParams(1.0, 3, 1.0, trial), 2,
                             collect_features=True)  # fmt: skip
        _eagle_rounds(eagle_hub, seq, 3)
        key = (seq.generated[0], seq.generated[1])
        counts[key] = counts.get(key, 0) + 1
    cells = sorted(expected)
    assert set(counts) <= set(cells)
    observed = [counts.get(c, 0) for c in cells]
    result = stats.chisquare(observed, [3000 * expected[c] for c in cells])
    assert result.pvalue > 1e-3, (result, observed)


def _two_token_law(target: models.LoadedModel, prompt: list[int],
                   params: SamplingParams) -> dict[tuple[int, int], float]:  # fmt: skip
    law = {}
    first = _probs(target, prompt, params)
    for a in torch.nonzero(first).flatten().tolist():
        second = _probs(target, [*prompt, a], params)
        for b in torch.nonzero(second).flatten().tolist():
            law[(a, b)] = float(first[a] * second[b])
    assert math.isclose(sum(law.values()), 1.0, rel_tol=1e-4)
    return law


def _probs(target: models.LoadedModel, ids: list[int], params: SamplingParams) -> torch.Tensor:
    logits = models.forward(target, ids, models.new_cache(target))[-1]
    return sampling.probs_from_logits(logits[None], params)[0]


@pytest.mark.slow
def test_three_targets_greedy_through_an_eagle_hub(
    tmp_path: Path, llama_pair: tuple[Path, Path], head_dir: Path
) -> None:
    prompts = ["To be, or not to be", "Now is the winter", "All the world", "O",
               "whether tis nobler", "Friends, Romans"]  # fmt: skip
    hub = HubProcess(head_dir, tmp_path / "hub.log", "--draft-kind", "eagle",
                     "--target", str(llama_pair[0]))  # fmt: skip
    targets = [TargetProcess(hub.endpoint, llama_pair[0],
                             write_prompts(tmp_path / f"in{i}.jsonl", prompts[2 * i : 2 * i + 2]),
                             tmp_path / f"out{i}.jsonl", "--concurrency", "2",
                             max_new_tokens=32) for i in range(3)]  # fmt: skip
    rounds = 0
    for t in targets:
        for row in t.wait():
            assert row["token_ids"] == reference(llama_pair[0], row["prompt"], 32), row["prompt"]
            rounds += row["stats"]["rounds"]
    assert rounds > 0
    assert hub.stop() == 0
    assert "EAGLE head" in hub.text()
