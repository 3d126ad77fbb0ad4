"""Token trees on the target: the tree's shape and mask (pure), and one forward over every node
in StarSD's own attention, against chain forwards of each node's path; then the accepted path
compacted in the KV pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge.backends.torch import TorchBackend
from starsd import tree
from starsd.batch import SequenceCache
from starsd.tree import TreeFeed

PROMPT = [5, 17, 33, 8, 21]
# root (the prompt's last token, uncached) -> 3 children; node 0 -> 2; node 3 -> 1
TOKENS = [40, 41, 42, 43, 44, 45]
PARENTS = [-1, -1, -1, 0, 0, 3]


def test_the_feed_mask_shows_each_node_its_ancestors_only() -> None:
    """Catches a node seeing a sibling or a cousin (its logits would depend on tokens not on
    its path), a node not seeing the prefix or itself, and a prefix that is not causal."""
    mask = tree.feed_mask(2, PARENTS)  # 2 prefix columns, then 6 nodes
    sees = {node: [c - 2 for c in range(2, 8) if mask[2 + node, c]] for node in range(6)}
    assert sees == {0: [0], 1: [1], 2: [2], 3: [0, 3], 4: [0, 4], 5: [0, 3, 5]}
    assert mask[2:, :2].all() and mask[:2, :2].tolist() == [[True, False], [True, True]]
    assert tree.feed_positions(2, PARENTS) == [0, 1, 2, 2, 2, 3, 3, 4]
    assert tree.kept_columns(2, [0, 3, 5]) == [0, 1, 2, 5, 7]
    assert tree.is_chain(tree.chain(4)) and not tree.is_chain(PARENTS)


@pytest.fixture(scope="module")
def backend(llama_pair: tuple[Path, Path]) -> TorchBackend:
    return TorchBackend.load(llama_pair[0])


def _prefilled(backend: TorchBackend, ids: list[int]) -> SequenceCache:
    return backend.forward([SequenceCache()], [ids])[0].cache


def test_one_tree_forward_equals_a_chain_forward_of_each_nodes_path(
    backend: TorchBackend,
) -> None:
    """Catches wrong tree positions (a node's RoPE angle not its depth's), a mask read the wrong
    way (a node attending a sibling), and a tree row disturbing a plain row batched with it:
    every node's logits equal those of the prompt + its path fed as a chain, and the plain
    row's equal its forward alone."""
    cache = _prefilled(backend, PROMPT[:-1])
    other = _prefilled(backend, [9, 10, 11])
    outs = backend.forward(
        [cache, other], [[PROMPT[-1], *TOKENS], [12, 13]], trees=[TreeFeed(1, PARENTS), None]
    )
    logits = outs[0].logits  # [1 + 6, V]: the root's row, then each node's
    for node in range(len(TOKENS)):
        path = [TOKENS[n] for n in tree.path_to(PARENTS, node)]
        (chain,) = backend.forward([_prefilled(backend, PROMPT[:-1])], [[PROMPT[-1], *path]])
        torch.testing.assert_close(logits[node + 1], chain.logits[-1], atol=1e-5, rtol=1e-4)
    (alone,) = backend.forward([_prefilled(backend, [9, 10, 11])], [[12, 13]])
    torch.testing.assert_close(outs[1].logits, alone.logits, atol=1e-5, rtol=1e-4)


def test_the_accepted_path_compacted_in_the_pool_continues_like_a_fresh_prefill(
    backend: TorchBackend,
) -> None:
    """Catches a compaction that keeps a rejected sibling's keys, moves the path's keys to the
    wrong positions, or leaves the cache the wrong length: after keeping path 0 -> 3 -> 5, the
    next token's logits equal a fresh prefill of prompt + path."""
    cache = _prefilled(backend, PROMPT[:-1])
    start = cache.length
    (out,) = backend.forward([cache], [[PROMPT[-1], *TOKENS]], trees=[TreeFeed(1, PARENTS)])
    path = [0, 3, 5]
    kept = out.cache
    kept.keep(start, tree.kept_columns(1, path))
    committed = [*PROMPT, *(TOKENS[n] for n in path)]
    assert kept.length == len(committed)
    (after,) = backend.forward([kept], [[7]])
    (fresh,) = backend.forward([_prefilled(backend, committed)], [[7]])
    torch.testing.assert_close(after.logits, fresh.logits, atol=1e-5, rtol=1e-4)


def test_a_backend_without_our_attention_refuses_trees(gpt2_pair: tuple[Path, Path]) -> None:
    """Catches a transformers-attention target verifying a tree as a chain (its nodes would
    see their siblings): it refuses, naming why."""
    gpt2 = TorchBackend.load(gpt2_pair[0])
    with pytest.raises(ValueError, match="no token trees"):
        gpt2.forward([SequenceCache()], [[1, 2, 3]], trees=[TreeFeed(1, [-1, -1])])
