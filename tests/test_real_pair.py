"""The default pair, SmolLM2-135M-Instruct and its trained draft: lossless through the hub.

The target directory is made by ``make install`` (``scripts.train.real_target``); the draft is
committed. These tests load both for real, so they are marked slow where they run the models.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import HubProcess, TargetProcess
from scipy import stats
from test_hub import _greedy_reference

from edge.backends.torch import TorchBackend
from edge.verifier import TargetSequence
from scripts.demo import distinct_ngrams
from starsd import hub as hub_module
from starsd import models, sampling
from starsd.hub.drafters.base import DraftJob
from starsd.hub.drafters.vocab import load_draft_vocab
from starsd.protocol import Error, SamplingParams

TARGET_DIR, DRAFT_DIR = models.PAIRS["smollm2"]
CHATS = [
    "What is an owl?",
    "Explain lightning in simple terms.",
    "Give me three facts about kites.",
]
CONTINUATIONS = ["The history of the printing press began"]


@pytest.fixture(scope="module")
def target() -> models.LoadedModel:
    assert (TARGET_DIR / "config.json").is_file(), f"{TARGET_DIR}: run `make install` first"
    return models.load_causal_lm(TARGET_DIR)


def test_the_committed_draft_maps_into_the_targets_vocabulary() -> None:
    """Catches a draft re-trained on another tokenizer or cut to another vocabulary: its map
    must point into SmolLM2's 49152 ids and the model must have one row per draft id plus the
    unknown row."""
    vocab = load_draft_vocab(DRAFT_DIR)
    assert vocab is not None and vocab.target_size == 49152
    rows = json.loads((DRAFT_DIR / "config.json").read_text())["vocab_size"]
    assert rows == vocab.size + 1
    assert int(vocab.d2t.max()) < 49152 and 2 in vocab.d2t.tolist()  # <|im_end|> can be drafted


@pytest.mark.slow
def test_greedy_chat_through_the_hub_equals_the_target_alone(
    target: models.LoadedModel, tmp_path: Path
) -> None:
    """Real processes: chat answers (--chat) through one hub equal transformers' greedy
    ``generate()`` in float32 token for token. Catches drift between the draft's reduced
    vocabulary and the target ids on the wire, and a chat the CLI renders differently from the
    tokenizer's template."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(CHATS))
    )
    hub = HubProcess(DRAFT_DIR, tmp_path / "hub.log", "--threads", "1")
    try:
        run = TargetProcess(
            hub.endpoint, TARGET_DIR, prompts, tmp_path / "out.jsonl", "--chat", max_new_tokens=40
        )
        results = {r["id"]: r for r in run.wait(timeout=400)}
    finally:
        hub.stop()
    for i, question in enumerate(CHATS):
        ids = models.chat_prompt_ids(target, [{"role": "user", "content": question}])
        assert results[i]["token_ids"] == _greedy_reference(target, ids, 40), question
    assert sum(r["stats"]["accepted"] for r in results.values()) > 0  # the draft is used
    # real English, not a loop (a conversion that scrambled weights still decodes, in circles)
    assert distinct_ngrams([r["token_ids"] for r in results.values()]) >= 0.6


@pytest.mark.slow
def test_a_plain_continuation_through_the_hub_equals_the_target_alone(
    target: models.LoadedModel, tmp_path: Path
) -> None:
    """Without --chat the prompt is plain text (no template): catches --chat leaking onto
    prompts that did not ask for it."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": 0, "prompt": CONTINUATIONS[0]}) + "\n")
    hub = HubProcess(DRAFT_DIR, tmp_path / "hub.log", "--threads", "1")
    try:
        run = TargetProcess(
            hub.endpoint, TARGET_DIR, prompts, tmp_path / "out.jsonl", max_new_tokens=32
        )
        (result,) = run.wait(timeout=300)
    finally:
        hub.stop()
    ids = models.encode_text(target, CONTINUATIONS[0])
    assert result["token_ids"] == _greedy_reference(target, ids, 32)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 600 trials of a 135M target: 3-5 minutes on 2 cores, by the phase
def test_sampling_through_the_real_draft_keeps_the_targets_law(target: models.LoadedModel) -> None:
    """Chi-square on the joint law of the first two sampled tokens (top-k 4), 600 trials, the
    real draft proposing 3 tokens a round. Catches a rejection step that resamples from p
    instead of the residual p - q, or q sent over the draft's ids: the draft agrees with p
    often here, so either bias moves the law by far more than the test allows."""
    hub = hub_module.build_hub(hub_module.HubConfig(model=str(DRAFT_DIR)))
    backend = TorchBackend(target)
    trials, prompt = 600, models.encode_text(target, "My favourite colour is")
    params = SamplingParams(1.0, top_k=4)
    expected = _two_token_law(target, prompt, params)
    counts: dict[tuple[int, int], int] = {}
    accepted = 0
    for trial in range(trials):
        seq = TargetSequence(backend, prompt, SamplingParams(1.0, 4, 1.0, trial), 2)
        accepted += _rounds(hub, seq, 3)
        key = (seq.generated[0], seq.generated[1])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(expected), "a token outside the target's top 4 appeared"
    big = sorted(c for c in expected if trials * expected[c] >= 5)  # the rest: one cell
    observed = [counts.get(c, 0) for c in big] + [trials - sum(counts.get(c, 0) for c in big)]
    wanted = [trials * expected[c] for c in big]
    wanted.append(trials - sum(wanted))
    assert stats.chisquare(observed, wanted).pvalue > 1e-3, (observed, wanted)
    assert accepted > trials // 4  # the draft's tokens were taken, so q mattered


def _rounds(hub: hub_module.Hub, seq: TargetSequence, gamma: int) -> int:
    """Speculate in process with the hub's proposer as over the wire; draft tokens accepted."""
    state = hub.proposer.new_state(list(seq.prompt), seq.params, gamma)
    job, taken = DraftJob(b"t", 0, state, 0, ()), 0
    while not seq.done:
        (proposal,) = hub.proposer.propose([job])
        assert not isinstance(proposal, Error), proposal
        support = (
            None
            if proposal.q_support is None
            else torch.from_numpy(proposal.q_support.astype(np.int64))
        )
        q = sampling.dense_q(torch.from_numpy(proposal.q_probs), support, seq.info.vocab_size)
        accepted, appended = seq.verify(proposal.tokens.tolist(), q)
        taken += accepted
        job = DraftJob(b"t", job.seq + 1, state, accepted, tuple(appended))
    return taken


def _two_token_law(
    target: models.LoadedModel, prompt: list[int], params: SamplingParams
) -> dict[tuple[int, int], float]:
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


def test_both_sides_default_to_the_real_pair_and_the_toy_pair_is_one_flag_away() -> None:
    """Catches a CLI left on the toy pair, or a --pair that one side ignores."""
    from edge.target import parse_args as target_args
    from starsd.hub.__main__ import parse_args as hub_args

    toy_target, toy_draft = models.PAIRS["toy"]
    real = hub_args([])  # the real pair's default drafter: its EAGLE-3 head on its target
    assert (real.draft_kind, real.model) == ("eagle3", str(models.DRAFTERS["smollm2"]["eagle3"]))
    assert real.target == str(TARGET_DIR)
    assert hub_args(["--pair", "toy"]).model == str(toy_draft)
    assert hub_args(["--pair", "toy", "--draft-kind", "eagle"]).target == str(toy_target)
    assert target_args(["--prompt", "x"]).model == str(TARGET_DIR)
    assert target_args(["--serve", "--pair", "toy"]).model == str(toy_target)
    assert target_args(["--prompt", "x", "--model", "elsewhere"]).model == "elsewhere"
