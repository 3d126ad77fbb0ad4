"""Token trees on the target: the tree's shape and mask (pure), and one forward over every node,
in StarSD's own attention and in transformers', against chain forwards of each node's path; then
the accepted path compacted in the row's cache."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from edge.backends.torch import TorchBackend
from edge.verifier import TargetSequence, verify_batch
from starsd import sampling, tree
from starsd.batch import SequenceCache
from starsd.protocol import SamplingParams
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


# The target's two attentions: StarSD's Llama forward over the KV pool, and transformers'
# forward over gathered buffers (a Llama's RoPE, GPT-2's learned positions), the tree's mask 4D.
FORWARDS = ["pooled-llama", "transformers-llama", "transformers-gpt2"]


@pytest.fixture(scope="module", params=FORWARDS)
def backend(request: pytest.FixtureRequest) -> TorchBackend:
    forward, family = request.param.split("-")
    pair = request.getfixturevalue(f"{family}_pair")
    return TorchBackend.load(pair[0], forward="auto" if forward == "pooled" else "transformers")


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


GREEDY = SamplingParams()


def _alone(backend: TorchBackend, prompt: list[int], n: int) -> list[int]:
    seq = TargetSequence(backend, prompt, GREEDY, n)
    while not seq.done:
        seq.step()
    return seq.generated


def test_greedy_tree_rounds_in_a_batch_equal_the_target_alone(backend: TorchBackend) -> None:
    """Catches a tree verification that commits a node off the argmax path, the wrong next
    token, or a cache compacted wrongly (the next rounds would drift from the target alone):
    rounds whose trees hide the target's own next two tokens behind wrong siblings, batched
    with a plain chain row, commit exactly the target alone's tokens, two drafts a round."""
    prompts, n = [[5, 17, 33, 8], [9, 3]], 12
    want = [_alone(backend, p, n) for p in prompts]
    seqs = [TargetSequence(backend, p, GREEDY, n) for p in prompts]
    while not all(s.done for s in seqs):
        live = [s for s in seqs if not s.done]
        rows, shapes = [], []
        for s in live:
            i = len(s.generated)
            truth = want[seqs.index(s)][i : i + 2]
            if len(truth) < 2 or s is seqs[1]:  # the chain row: the right first token only
                rows.append((s, truth[:1], None))
                shapes.append(None)
                continue
            wrong = [(t + 1) % backend.info.vocab_size for t in truth]
            rows.append((s, [wrong[0], truth[0], wrong[1], truth[1]], None))
            shapes.append([-1, -1, 1, 1])  # root: wrong, right; under right: wrong, right
        results = verify_batch(backend, rows, shapes)
        for (s, drafts, _), shape, (accepted, _) in zip(rows, shapes, results, strict=True):
            assert accepted == (2 if shape else len(drafts)) or s.done
    assert [s.generated for s in seqs] == want


def test_sampled_tree_verification_keeps_the_targets_law(backend: TorchBackend) -> None:
    """Catches a sampled tree verification (through the batched verify, q rows per parent)
    whose first emitted token does not follow p: a wrong q row per node, a sibling judged
    against the original q, or p's rows read at the wrong node (chi-square over p's likely
    tokens, 1500 rounds)."""
    params = SamplingParams(temperature=1.0, top_k=8, seed=3)
    prompt = [5, 17, 33, 8]
    probe = TargetSequence(backend, prompt, params, 1)
    (out,) = backend.forward([probe.cache], [probe.uncached()])
    p = sampling.probs_from_logits(out.logits[-1:], params)[0]  # the first token's law
    q = torch.softmax(
        torch.randn(backend.info.vocab_size, generator=torch.Generator().manual_seed(1)), -1
    )
    gen, counts = torch.Generator().manual_seed(4), torch.zeros_like(p)
    for _ in range(1500):
        seq = TargetSequence(backend, prompt, params, 1)
        seq.generator = torch.Generator().manual_seed(
            int(torch.randint(0, 2**31, (1,), generator=gen))
        )
        kids = sampling.draw_children(q, 3, gen).tolist()
        seq.verify(kids, q.expand(3, -1).clone(), [-1, -1, -1])
        counts[seq.generated[0]] += 1
    likely = p > 0.02
    expected = p[likely] / p[likely].sum() * counts[likely].sum()
    assert stats.chisquare(counts[likely].numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize(
    ("drafts", "parents", "q", "problem"),
    [
        ([1, 2], [-1, 1], None, "node 1 names parent 1"),
        ([1, 2], [-1], None, "1 parents for 2 tree nodes"),
        ([1, 2, 3], [-1, -1, 0], "siblings differ", "q differs from its sibling"),
    ],
)
def test_a_malformed_tree_proposal_is_refused_before_any_forward(
    backend: TorchBackend, drafts: list[int], parents: list[int], q: str | None, problem: str
) -> None:
    """Catches a cycle or forward reference, parents that do not match the tokens, or
    siblings claiming different laws reaching the forward (a cycle would hang the walk; a
    sibling law that differs makes the rejection rule lossy)."""
    params = SamplingParams(temperature=1.0, seed=1) if q else GREEDY
    seq = TargetSequence(backend, [5, 17], params, 4)
    q_probs = None
    if q:
        q_probs = torch.full((3, backend.info.vocab_size), 1.0 / backend.info.vocab_size)
        q_probs[1] = torch.softmax(torch.arange(backend.info.vocab_size).float(), -1)
    with pytest.raises(ValueError, match=problem):
        verify_batch(backend, [(seq, drafts, q_probs)], [parents])
    assert seq.generated == [] and seq.cached == 1
