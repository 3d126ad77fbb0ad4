"""The real target's committed EAGLE-3 head (models/smollm2-eagle3): lossless through the hub.

The target directory is made by ``make install`` (``scripts.train.real_target``); without it
these tests skip. The head is committed (``make real-eagle-heads``).
"""

from __future__ import annotations

import pytest
from greedy import assert_greedy
from test_eagle_hub import _eagle_rounds, greedy_alone
from test_tree_draft import _tree_rounds

from edge.backends.torch import TorchBackend
from edge.verifier import TargetSequence
from starsd import hub as hub_module
from starsd import models
from starsd.protocol import SamplingParams
from starsd.tree_shapes import TreeShape

TARGET_DIR = models.PAIRS["smollm2"][0]
HEAD_DIR = TARGET_DIR.parent / "smollm2-eagle3"
CHATS = ["What is an owl?", "Give me three facts about kites."]
NEW_TOKENS = 24

pytestmark = pytest.mark.skipif(
    not (TARGET_DIR / "config.json").is_file(), reason=f"{TARGET_DIR}: run `make install` first"
)


def _real_hub_and_target() -> tuple[hub_module.Hub, models.LoadedModel, TorchBackend]:
    """An in-process hub drafting with the committed head, and the real target to verify."""
    config = hub_module.HubConfig(
        model=str(HEAD_DIR), draft_kind="eagle3", target=str(TARGET_DIR), threads=1
    )
    target = models.load_causal_lm(TARGET_DIR)
    return hub_module.build_hub(config), target, TorchBackend(target)


@pytest.mark.slow
def test_greedy_through_the_real_eagle3_head_equals_the_target_alone() -> None:
    """Catches a real-width head that drafts in draft ids proposed as target ids, taps the
    wrong layers of a 30-layer target, or loses its place after a verdict: greedy chat answers
    through the hub's EAGLE-3 proposer equal transformers' ``generate()`` (float32) token for
    token, and the head's drafts are accepted."""
    hub, target, backend = _real_hub_and_target()
    rounds: list[int] = []
    for question in CHATS:
        prompt = models.chat_prompt_ids(target, [{"role": "user", "content": question}])
        seq = TargetSequence(
            backend, prompt, SamplingParams(), NEW_TOKENS, taps=hub.proposer.feature_layers
        )
        rounds += _eagle_rounds(hub, seq, 4)
        assert seq.generated == greedy_alone(target, prompt, NEW_TOKENS), question
    assert sum(rounds) > 0, rounds  # the head's drafts are used, not all rejected


@pytest.mark.slow
def test_greedy_through_the_real_heads_token_trees_equals_the_target_alone() -> None:
    """Catches a tree verified wrongly at the real target's width and depth (a node seeing a
    sibling through the 30-layer forward's mask, a compaction that keeps a rejected node's keys
    in the pool, a head that loses its place after a path): greedy chat answers drafted as a
    2 x 4 tree of 8 nodes every round equal the target alone, with paths longer than one node."""
    hub, target, backend = _real_hub_and_target()
    paths: list[int] = []
    for question in CHATS:
        prompt = models.chat_prompt_ids(target, [{"role": "user", "content": question}])
        seq = TargetSequence(
            backend, prompt, SamplingParams(), NEW_TOKENS, taps=hub.proposer.feature_layers
        )
        paths += _tree_rounds(hub, seq, TreeShape(2, 4, 8))
        assert_greedy(target, prompt, seq.generated, greedy_alone(target, prompt, NEW_TOKENS))
    assert max(paths) > 1, paths  # some round kept more than one node of a tree
