"""A draft over a reduced vocabulary (starsd/hub/drafters/vocab.py): the maps, loading, drafting
in target ids, and the target's output through it (greedy exact, sampled law by chi-square)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from test_hub import _greedy_reference

from edge.backends.torch import TorchBackend
from edge.verifier import TargetSequence
from starsd import hub as hub_module
from starsd import models, sampling
from starsd.hub.drafters.base import DraftJob
from starsd.hub.drafters.vocab import VOCAB_FILE, DraftVocab, load_draft_vocab, save_draft_vocab
from starsd.protocol import Error, SamplingParams

KEPT = 300  # the draft predicts 300 of the target's 320 ids, in a shuffled order
KEPT_IDS = torch.randperm(320, generator=torch.Generator().manual_seed(0))[:KEPT]
MISSING = sorted(set(range(320)) - set(KEPT_IDS.tolist()))  # target ids without a draft id


# ---------------------------------------------------------------------- the maps


def test_maps_go_both_ways_and_unknown_ids_take_the_reserved_row() -> None:
    vocab = DraftVocab.from_ids(torch.tensor([7, 3, 11]), 16)
    assert vocab.size == 3 and vocab.to_target(torch.tensor([0, 2])).tolist() == [7, 11]
    assert vocab.to_draft(torch.tensor([3, 11, 5]), unknown=3).tolist() == [1, 2, 3]
    q = vocab.expand(torch.tensor([[0.5, 0.25, 0.25]]))  # [1, 16]: zero outside the draft's ids
    assert q[0, 7] == 0.5 and q[0, 3] == 0.25 and float(q.sum()) == 1.0


def test_eagle3_offsets_read_as_the_same_map() -> None:
    """EAGLE-3 stores d2t as offsets (target = draft + d2t[draft]) and t2d as a mask."""
    ids = torch.tensor([0, 4, 5, 9])
    mask = torch.zeros(12, dtype=torch.bool)
    mask[ids] = True
    vocab = DraftVocab.from_offsets(ids - torch.arange(4), 12, mask)
    assert vocab.d2t.tolist() == [0, 4, 5, 9]
    with pytest.raises(ValueError, match="does not mark"):
        DraftVocab.from_offsets(ids - torch.arange(4), 12, ~mask)


@pytest.mark.parametrize(
    ("ids", "why"),
    [
        ([1, 2, 16], "outside 0..15"),
        ([-1, 2], "outside"),
        ([3, 3], "two draft ids"),
        ([], "at least"),
    ],
)
def test_a_map_outside_the_target_vocabulary_is_refused(ids: list[int], why: str) -> None:
    # Catches a draft whose ids point past the target's vocabulary: its proposals would be
    # refused by every target (or, unchecked, index out of range there).
    with pytest.raises(ValueError, match=why):
        DraftVocab.from_ids(torch.tensor(ids, dtype=torch.int64), 16)


def test_a_corrupt_vocabulary_file_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / VOCAB_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=VOCAB_FILE):
        load_draft_vocab(tmp_path)
    assert load_draft_vocab(tmp_path / "nowhere") is None


# ---------------------------------------------------------------------- a reduced draft


@pytest.fixture(scope="module")
def reduced_draft(llama_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny draft cut to KEPT_IDS (draft id i = target id KEPT_IDS[i]) plus the reserved
    row (the mean of the rest)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("reduced") / "llama-draft-reduced"
    shutil.copytree(llama_pair[1], out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    embed = model.get_input_embeddings().weight.data  # [320, H]
    rest = embed[MISSING].mean(0, keepdim=True)
    rows = torch.cat([embed[KEPT_IDS], rest])  # [KEPT + 1, H]
    model.resize_token_embeddings(KEPT + 1)
    model.get_input_embeddings().weight.data.copy_(rows)
    model.tie_weights()
    model.save_pretrained(out)
    save_draft_vocab(DraftVocab.from_ids(KEPT_IDS, len(embed)), out)
    return out


@pytest.fixture(scope="module")
def reduced_hub(reduced_draft: Path) -> hub_module.Hub:
    return hub_module.build_hub(hub_module.HubConfig(model=str(reduced_draft)))


def test_the_hub_speaks_the_targets_vocabulary(
    reduced_hub: hub_module.Hub, llama_target: models.LoadedModel
) -> None:
    # Catches WELCOME announcing the draft's K + 1 rows: every target would be refused.
    assert reduced_hub.welcome.vocab_size == llama_target.vocab_size
    assert reduced_hub.welcome.tokenizer == llama_target.tokenizer_fingerprint


def _rounds(hub: hub_module.Hub, seq: TargetSequence, gamma: int) -> list[list[int]]:
    """Speculate in process with the hub's proposer as over the wire; the proposals' tokens."""
    state = hub.proposer.new_state(list(seq.prompt), seq.params, gamma)
    job = DraftJob(b"t", 0, state, 0, ())
    drafted = []
    while not seq.done:
        (proposal,) = hub.proposer.propose([job])
        assert not isinstance(proposal, Error), proposal
        q = None
        if not seq.params.greedy and len(proposal.tokens):
            support = (
                None
                if proposal.q_support is None
                else torch.from_numpy(proposal.q_support.astype(np.int64))
            )
            q = sampling.dense_q(torch.from_numpy(proposal.q_probs), support, seq.info.vocab_size)
        drafted.append(proposal.tokens.tolist())
        accepted, appended = seq.verify(drafted[-1], q)
        job = DraftJob(b"t", job.seq + 1, state, accepted, tuple(appended))
    return drafted


def test_greedy_through_a_reduced_draft_equals_the_target_alone(
    reduced_hub: hub_module.Hub, llama_target: models.LoadedModel
) -> None:
    """Catches drafting in draft ids leaking onto the wire (proposals of draft ids would be
    rejected wholesale: acceptance 0) and committed target ids fed to the draft unmapped (ids
    past its K + 1 rows fail the forward). The prompts hold ids without a draft id."""
    backend = TorchBackend(llama_target)
    drafted: list[list[int]] = []
    accepted = 0
    for prompt in ([5, 17, 33, 8], [MISSING[0], 2, MISSING[1], 9], [*MISSING, 40, 41]):
        seq = TargetSequence(backend, prompt, SamplingParams(), 40)
        drafted += _rounds(reduced_hub, seq, 4)
        accepted += seq.stats.accepted
        assert seq.generated == _greedy_reference(llama_target, prompt, 40)
    tokens = {t for p in drafted for t in p}
    assert tokens and tokens <= set(KEPT_IDS.tolist())  # what the draft can predict, target ids
    assert accepted > 0  # in target ids: the target's argmax is drafted some of the time


def test_sampling_through_a_reduced_draft_keeps_the_targets_law(
    reduced_hub: hub_module.Hub, llama_target: models.LoadedModel
) -> None:
    """Chi-square on the joint law of the first two tokens, 2000 trials. Catches q sent over
    the wrong support (the draft's ids for the target's) and a rejection step that mishandles
    q = 0 outside the draft's vocabulary: tokens 300..319 must still come out as often as p
    says (only from the residual or the bonus)."""
    trials, prompt, params = 2000, [5, 17, 33, 8], SamplingParams(1.0)
    expected = _two_token_law(llama_target, prompt, params)
    counts: dict[tuple[int, int], int] = {}
    backend = TorchBackend(llama_target)
    for trial in range(trials):
        seq = TargetSequence(backend, prompt, SamplingParams(1.0, seed=trial), 2)
        _rounds(reduced_hub, seq, 3)
        key = (seq.generated[0], seq.generated[1] if len(seq.generated) > 1 else -1)  # -1: EOS
        counts[key] = counts.get(key, 0) + 1
    big = sorted(c for c in expected if trials * expected[c] >= 5)  # the rest: one cell
    observed = [counts.get(c, 0) for c in big] + [trials - sum(counts.get(c, 0) for c in big)]
    wanted = [trials * expected[c] for c in big]
    wanted.append(trials - sum(wanted))
    assert stats.chisquare(observed, wanted).pvalue > 1e-3


def _two_token_law(
    target: models.LoadedModel, prompt: list[int], params: SamplingParams
) -> dict[tuple[int, int], float]:
    first = _probs(target, prompt, params)
    law = {}
    for a in torch.nonzero(first > 1e-6).flatten().tolist():
        if a in target.eos_token_ids:  # the sequence ends there
            law[(a, -1)] = float(first[a])
            continue
        second = _probs(target, [*prompt, a], params)
        for b in torch.nonzero(second > 1e-6).flatten().tolist():
            law[(a, b)] = float(first[a] * second[b])
    assert math.isclose(sum(law.values()), 1.0, rel_tol=1e-3)
    return law


def _probs(target: models.LoadedModel, ids: list[int], params: SamplingParams) -> torch.Tensor:
    logits = models.forward(target, ids, models.new_cache(target))[-1]
    return sampling.probs_from_logits(logits[None], params)[0]


def test_a_draft_whose_rows_do_not_fit_its_vocabulary_is_refused_at_start(
    reduced_draft: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(reduced_draft, bad)
    save_draft_vocab(DraftVocab.from_ids(torch.arange(100), 320), bad)
    with pytest.raises(ValueError, match="token rows"):
        hub_module.build_hub(hub_module.HubConfig(model=str(bad)))
