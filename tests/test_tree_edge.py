"""Token trees on the target's side of the wire: what HELLO announces and what a connection's
budget is, what a tree proposal must be to be verified, the depth a sequence has room for, the
path its DRAFT names; then the toy target verifying a scripted hub's trees (greedy output equal
to generate() alone) and a hostile hub's bad trees (each refused, the output still the target
alone's). Pure checks first, then in-process targets on loopback."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from test_hub import _greedy_reference

from edge import speculate
from edge.backends.onnxruntime import OnnxBackend
from edge.backends.torch import TorchBackend
from edge.batcher import Batcher
from edge.client import HubClient
from edge.engine import Engine
from edge.handshake import TargetInfo, checked_welcome
from edge.hubs import HubPool
from edge.speculate import Fallback, HubSession, ProposalRefused, checked_draft, usable_draft
from edge.verifier import TargetSequence, announced_tree_nodes, check_proposal
from scripts.hostile.fake_hub import Attack, FakeHub, Session
from starsd import limits, models, protocol, transport, tree
from starsd.protocol import Proposal, SamplingParams, Welcome

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, seed=5)
TOKENS = [40, 41, 42, 43, 44, 45]
PARENTS = [-1, -1, -1, 0, 0, 3]  # root -> 0, 1, 2; node 0 -> 3, 4; node 3 -> 5
ANNOUNCED = min(64, limits.MAX_TREE_NODES)  # what a target whose backend verifies trees says

# ---------------------------------------------------------------------- pure: tree shapes


def test_the_accepted_path_is_walked_from_the_committed_tokens() -> None:
    """Catches a walk that names nodes in drawing order instead of by token (a DRAFT naming
    the first sibling whatever was accepted), one that matches a token anywhere in the tree
    rather than among the children of the path so far, and an off-by-one between a node and
    its row."""
    assert tree.accepted_path(TOKENS, PARENTS, [40, 43, 45]) == [0, 3, 5]
    assert tree.accepted_path(TOKENS, PARENTS, [40, 44]) == [0, 4]
    assert tree.accepted_path(TOKENS, PARENTS, [42]) == [2]
    assert tree.accepted_path(TOKENS, PARENTS, []) == []
    assert tree.accepted_path([7, 8, 9], tree.chain(3), [7, 8]) == [0, 1]
    with pytest.raises(ValueError, match="not a child of row 0"):
        tree.accepted_path(TOKENS, PARENTS, [43])  # node 3's token, but under node 0
    with pytest.raises(ValueError, match="not a child of row 1"):
        tree.accepted_path(TOKENS, PARENTS, [40, 41])  # a root child, not node 0's


def test_cropping_to_a_depth_keeps_a_renumbered_subtree() -> None:
    """Catches cropping by node count (the first n nodes keep a deep node and drop a shallow
    one listed after it) and kept parents left in the old numbering (a node would hang under
    the wrong parent)."""
    parents = [-1, 0, 1, -1, 3, 0]  # depths 1, 2, 3, 1, 2, 2
    assert tree.crop_depth(parents, 0) == ([], [])
    assert tree.crop_depth(parents, 1) == ([0, 3], [-1, -1])
    assert tree.crop_depth(parents, 2) == ([0, 1, 3, 4, 5], [-1, 0, -1, 2, 0])
    assert tree.crop_depth(parents, 3) == (list(range(6)), parents)
    for depth in range(4):
        assert tree.tree_problem(tree.crop_depth(parents, depth)[1], 8) is None


def test_siblings_must_hold_distinct_tokens() -> None:
    """Catches a repeated sibling getting past the tree rules (recursive rejection sampling
    would try one token twice, and the path could not be named from its tokens), and a rule
    so broad it refuses a token repeated by a cousin or a child of its own kind."""
    assert "repeats token 5 of its sibling 0" in (tree.sibling_problem([5, 5], [-1, -1]) or "")
    assert "node 3 repeats" in (tree.sibling_problem([5, 6, 7, 7], [-1, -1, 0, 0]) or "")
    assert tree.sibling_problem([5, 6, 5, 5], [-1, -1, 0, 1]) is None  # cousins
    assert tree.sibling_problem([5, 5, 5], [-1, 0, 1]) is None  # a chain of one token


# ---------------------------------------------------------------------- pure: proposals


class _Info:
    vocab_size, max_positions, hidden_size = 50, 256, 8
    eos_token_ids: frozenset[int] = frozenset()


class _Seq:
    """What :func:`checked_draft` and :func:`check_proposal` read of a TargetSequence."""

    def __init__(self, params: SamplingParams = GREEDY, max_new_tokens: int = 64) -> None:
        self.info, self.params = _Info(), params
        self.max_new_tokens, self.generated, self.committed = max_new_tokens, [], 4
        self.done, self.cache = False, object()


def _tree(tokens: list[int], parents: list[int], **fields: Any) -> Proposal:
    return Proposal(
        b"t" * 16,
        0,
        np.array(tokens, np.int32),
        parents=np.array(parents, np.int32),
        **fields,
    )


def _sibling_q(parents: list[int], vocab: int = 50) -> np.ndarray:
    """q rows as an honest hub sends them: node i's row is its parent's law, siblings the same
    row; uniform laws, distinct per parent."""
    q = np.zeros((len(parents), vocab), np.float32)
    for node, parent in enumerate(parents):
        q[node] = np.roll(np.linspace(1, 2, vocab, dtype=np.float32), parent + 1)
    return q / q.sum(-1, keepdims=True)


_BAD_TREES = [
    ("cycle", _tree([1, 2, 3], [1, 0, -1]), 8, "node 0 names parent 1"),
    ("forward reference", _tree([1, 2, 3], [-1, 2, 0]), 8, "node 1 names parent 2"),
    ("parent out of range", _tree([1, 2], [-1, 7]), 8, "node 1 names parent 7"),
    ("parent below -1", _tree([1, 2], [-1, -3]), 8, "node 1 names parent -3"),
    ("duplicate siblings", _tree([4, 4], [-1, -1]), 8, "repeats token 4"),
    ("parents length", _tree([1, 2, 3], [-1, 0]), 8, "2 parents for 3 tree nodes"),
    ("over the budget", _tree(list(range(9)), [-1] * 9), 8, "over this connection's budget of 8"),
    ("a chains-only connection", _tree([1, 2], [-1, 0]), 0, "verifies chains only"),
    ("a pushed branch", _tree([1, 2], [-1, -1], if_accepted=0, if_appended=3), 8, "pushed branch"),
]


@pytest.mark.parametrize(
    ("proposal", "budget", "why"),
    [case[1:] for case in _BAD_TREES],
    ids=[case[0] for case in _BAD_TREES],
)
def test_a_bad_tree_is_refused_naming_why(proposal: Proposal, budget: int, why: str) -> None:
    """Catches each bad tree reaching the model thread (a cycle would loop the path walk, an
    out-of-range parent index the cache, a duplicate sibling biases sampling) or a tree
    verified on a connection that never agreed to trees or past its budget."""
    with pytest.raises(ProposalRefused, match=re.escape(why)):
        checked_draft(_Seq(), proposal, max_gamma=16, tree_nodes=budget)  # type: ignore[arg-type]


def test_siblings_claiming_different_laws_are_refused() -> None:
    """Catches a sampled tree whose siblings carry different q rows (they were drawn one after
    another from one law; judging each against its own row is lossy)."""
    parents = [-1, -1, 0]
    q = _sibling_q(parents)
    q[1] = np.roll(q[1], 3)
    with pytest.raises(ProposalRefused, match="q differs from its sibling 0"):
        checked_draft(_Seq(SAMPLED), _tree([1, 2, 3], parents, q_probs=q), 16, 8)  # type: ignore[arg-type]


def test_an_honest_tree_passes_within_the_budget_not_max_gamma() -> None:
    """Catches a tree held to the hub's max_gamma (a chain's limit) instead of the tree
    budget, and q or parents lost on the way to the verifier."""
    parents = [-1, -1, -1, 0, 0, 3, 3, 1, 1, 2, 4, 5]
    tokens = [10 + n for n in range(len(parents))]
    q = _sibling_q(parents)
    draft = checked_draft(_Seq(SAMPLED), _tree(tokens, parents, q_probs=q), 8, 16)  # type: ignore[arg-type]
    assert draft.drafts == tokens and draft.parents == parents
    assert draft.q is not None and torch.equal(draft.q, torch.from_numpy(q))
    greedy = checked_draft(_Seq(), _tree(tokens, parents), 8, 16)  # type: ignore[arg-type]
    assert greedy == (tokens, None, parents)


@pytest.mark.parametrize("support", [False, True], ids=["dense q", "q support"])
def test_a_tree_deeper_than_the_room_left_is_cropped_with_its_q_rows(support: bool) -> None:
    """Catches a tree cropped like a chain (its first n nodes: node 2 at depth 3 kept, node 3
    at depth 1 dropped), parents not renumbered, q rows (dense or with their support) not
    following the nodes kept, and the context limit ignored."""
    parents = [-1, 0, 1, -1, 3, 0]  # depths 1, 2, 3, 1, 2, 2
    tokens = [10, 11, 12, 13, 14, 15]
    if support:
        fields = {
            "q_probs": np.tile(np.array([0.7, 0.3], np.float32), (6, 1)),
            "q_support": np.array([[t, 49 - n] for n, t in enumerate(tokens)], np.int32),
        }
    else:
        fields = {"q_probs": np.eye(50, dtype=np.float32)[tokens]}
    seq = _Seq(SAMPLED, max_new_tokens=3)  # room for 2 drafts and the target's own token
    drafts, q, kept_parents = usable_draft(seq, _tree(tokens, parents, **fields))  # type: ignore[arg-type]
    assert (drafts, kept_parents) == ([10, 11, 13, 14, 15], [-1, 0, -1, 2, 0])
    assert q is not None and q.shape == (5, 50)
    assert [int(row.argmax()) for row in q] == drafts  # each node's own row
    seq = _Seq(SAMPLED)
    seq.committed = seq.info.max_positions - 1  # the context has room for depth 1
    drafts, q, kept_parents = usable_draft(seq, _tree(tokens, parents, **fields))  # type: ignore[arg-type]
    assert (drafts, kept_parents) == ([10, 13], [-1, -1])
    assert q is not None and [int(row.argmax()) for row in q] == drafts


def test_a_tree_near_the_context_end_is_measured_by_its_depth() -> None:
    """Catches the chain's length rule applied to a tree in the model thread: an honest tree
    of more nodes than positions left, but no deeper, refused there (and its hub struck)."""
    seq = _Seq()
    seq.committed = seq.info.max_positions - 3
    check_proposal(seq, TOKENS, None, PARENTS)  # type: ignore[arg-type]  # 6 nodes, depth 3
    with pytest.raises(ValueError, match="positions exceed"):
        check_proposal(seq, TOKENS, None, None)  # type: ignore[arg-type]  # a chain of 6
    with pytest.raises(ValueError, match="positions exceed"):
        check_proposal(seq, [1, 2, 3, 4], None, [-1, 0, 1, 2])  # type: ignore[arg-type]


def test_a_tree_is_never_held_as_a_pushed_branch() -> None:
    """Catches a tree kept among a session's branches: taken, it would be verified without
    the tree checks' budget, as a branch the protocol says a tree never is."""
    session = HubSession(None, b"t" * 16, asyncio.Queue(), 1, 4, expected=3, push=4)  # type: ignore[arg-type]
    chain = replace(_tree([1], [-1]), parents=None, seq=4, if_accepted=0, if_appended=7)
    speculate._hold(session, replace(chain, parents=np.array([-1], np.int32)), 4)
    assert session.branches == {}
    speculate._hold(session, chain, 4)
    assert list(session.branches) == [(4, 0, 7)]


# ---------------------------------------------------------------------- pure: the handshake


@pytest.fixture
def ctx() -> Iterator[Any]:
    context = transport.new_context()
    yield context
    context.term()


def _welcome(**fields: Any) -> Welcome:
    return replace(Welcome("d", 320, "fp", b"e" * protocol.EPOCH_BYTES, 4, 16), **fields)


async def test_the_budget_is_the_smaller_offer_and_a_welcome_is_clamped(ctx: Any) -> None:
    """Catches a connection budget that trusts the hub's offer beyond what the target
    announced (or the wire's frames hold), a negative offer read as a budget, and trees
    still allowed while the hub is down."""
    huge, changed = checked_welcome(_welcome(tree_nodes=1 << 40))
    assert huge.tree_nodes == limits.MAX_TREE_NODES and changed
    assert checked_welcome(_welcome(tree_nodes=-3))[0].tree_nodes == 0
    client = HubClient(ctx, "tcp://127.0.0.1:1", TargetInfo("t", 320, "fp", tree_nodes=16))
    try:
        for offered, budget in ((0, 0), (8, 8), (16, 16), (huge.tree_nodes, 16)):
            client.welcome = _welcome(tree_nodes=offered)
            assert client.tree_nodes == budget
        client.welcome = None
        assert client.tree_nodes == 0
        chains = HubClient(ctx, "tcp://127.0.0.1:1", TargetInfo("t", 320, "fp"))
        chains.welcome = _welcome(tree_nodes=16)
        assert chains.tree_nodes == 0
        await chains.aclose()
    finally:
        await client.aclose()


async def test_hello_announces_trees_only_for_a_backend_that_verifies_them(
    ctx: Any, llama_pair: tuple[Path, Path], gpt2_pair: tuple[Path, Path]
) -> None:
    """Catches a target announcing trees its backend cannot verify (the ONNX graph takes no
    mask: every tree would fail in the model thread) or not announcing them when it can
    (StarSD's attention and transformers', a GPT-2 here)."""
    for pair, announced in ((llama_pair, ANNOUNCED), (gpt2_pair, ANNOUNCED)):
        backend = TorchBackend.load(pair[0])
        assert announced_tree_nodes(backend.info) == announced
        pool = HubPool.for_model(ctx, ("tcp://127.0.0.1:1",), backend.info, 0)
        assert pool.clients[0]._hello_msg().tree_nodes == announced  # type: ignore[attr-defined]
        await pool.aclose()
    manifest = SimpleNamespace(
        name="m",
        vocab_size=8,
        hidden_size=4,
        tokenizer_fingerprint="f",
        eos_token_ids=[1],
        max_positions=64,
    )
    onnx_info = OnnxBackend._model_info(SimpleNamespace(manifest=manifest, limits=None))  # type: ignore[arg-type]
    assert announced_tree_nodes(onnx_info) == 0


# ---------------------------------------------------------------------- in-process targets

N = 24  # tokens per sequence
PROMPTS = ["ROMEO:\nBut soft, what light", "HAMLET:\nTo be, or not", "KING:\nNow is the winter"]
PATIENT = Fallback(deadline_s=5.0, resync_s=30.0, open_timeout_s=5.0)  # no steps alone
FAST = Fallback(deadline_s=0.3, resync_s=2.0, open_timeout_s=1.0)


@pytest.fixture(scope="module", params=["auto", "transformers"])
def toy(request: pytest.FixtureRequest) -> TorchBackend:
    """The committed toy target (a plain Llama) in StarSD's own attention over the KV pool, and
    in transformers' over gathered buffers (the tree's mask 4D)."""
    return TorchBackend.load(models.TOY_TARGET_DIR, forward=request.param)


@pytest.fixture(scope="module")
def prompts(toy: TorchBackend) -> list[list[int]]:
    return [toy.encode(text) for text in PROMPTS]


@pytest.fixture(scope="module")
def references(toy: TorchBackend, prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """generate() alone: what every run through a hub must produce."""
    return {tuple(p): _greedy_reference(toy.loaded, p, N) for p in prompts}


async def _run(
    endpoint: str,
    backend: TorchBackend,
    prompts: list[list[int]],
    fallback: Fallback,
    info: TargetInfo | None = None,
) -> list[TargetSequence]:
    """Decode ``prompts`` greedily through the hub at ``endpoint`` (HELLO as the CLI sends it
    for ``backend``, unless ``info`` says otherwise)."""
    ctx = transport.new_context()
    pool = (
        HubPool.for_model(ctx, (endpoint,), backend.info, 0)
        if info is None
        else HubPool.create(ctx, (endpoint,), info)
    )
    try:
        async with Batcher(backend) as batcher:
            engine = Engine(backend, batcher, pool, 0, fallback)
            await pool.connect(timeout=5.0)
            seqs = [engine.new_sequence(p, GREEDY, N) for p in prompts]
            await asyncio.wait_for(asyncio.gather(*(engine.run(s) for s in seqs)), 120)
    finally:
        await pool.aclose()
        ctx.term()
    return seqs


@dataclass
class Sent:
    """A proposal the scripted hub sent, and the path it expects back."""

    tokens: list[int]
    parents: list[int] | None
    expected: list[int]  # the path (a chain: its first tokens) the target's argmax takes
    room: int  # draft tokens the sequence had room for (max_new_tokens less one)


# The tree the scripted hub sends: a decoy branch 3 deep listed first (so cropping to depth 2
# renumbers every node after it), then the target's next token with one child, then another.
TREE = [-1, 0, 1, -1, 3, 4]  # d0 - d1 - d2, t0 - x - y; depths 1, 2, 3, 1, 2, 3


class TreeHub(FakeHub):
    """A scripted hub that knows the target's greedy output (generate()) and proposes trees
    hiding it among decoys, with a chain every third round; it keeps each session's committed
    tokens from the DRAFTs' paths and records every DRAFT beside what it answered."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        super().__init__(Attack("trees", welcome={"tree_nodes": 16}))
        self.references, self.vocab_size = references, vocab
        self.hellos: list[protocol.Hello] = []
        self.committed: dict[bytes, list[int]] = {}
        self.sent: dict[tuple[bytes, int], Sent] = {}
        self.answers: list[tuple[Sent, protocol.Draft]] = []
        self._opening: list[int] = []

    def _welcome(self, peer: bytes, hello: protocol.Hello) -> None:
        self.hellos.append(hello)
        super()._welcome(peer, hello)

    def _open(self, peer: bytes, msg: protocol.Open) -> None:
        self._opening = msg.prompt.tolist()
        super()._open(peer, msg)

    def _draft(self, peer: bytes, msg: protocol.Draft) -> None:
        sent = self.sent.get((msg.tag, msg.seq - 1))
        if sent is not None:
            self.answers.append((sent, msg))
            path = range(msg.accepted) if msg.path is None else msg.path.tolist()
            kept = [sent.tokens[n] for n in path]
            self.committed[msg.tag] += [*kept, *msg.appended.tolist()]
        super()._draft(peer, msg)

    def proposal(self, session: Session, seq: int) -> protocol.Proposal:
        committed = self.committed.setdefault(session.tag, list(self._opening))
        prompt = next(p for p in self.references if tuple(committed[: len(p)]) == p)
        done = len(committed) - len(prompt)
        truth = [*self.references[prompt][done:], 0, 0, 0][:3]
        room = N - done - 1
        tokens, parents, expected = self._shape(session.rounds, room, truth)
        self.sent[(session.tag, seq)] = Sent(tokens, parents, expected, room)
        return protocol.Proposal(
            session.tag,
            seq,
            np.array(tokens, np.int32),
            epoch=self.epoch,
            parents=None if parents is None else np.array(parents, np.int32),
        )

    def _shape(
        self, round_: int, room: int, truth: list[int]
    ) -> tuple[list[int], list[int] | None, list[int]]:
        """(tokens, parents, expected path) of this round's proposal. Near the end it steers
        the sequence to a round with room for 2 (a tree cropped to depth 2, whose path node 3
        is node 2 after renumbering) where it accepts 1 token, so a DRAFT answers it."""
        v = self.vocab_size
        t0, t1, t2 = truth
        if room > 5 and round_ % 3 == 0:
            return [t0, (t1 + 1) % v], None, [0]
        deep = room > 5 and round_ % 3 == 1
        x = t1 if deep else (t1 + 1) % v
        first = (t0 + 2) % v if room == 3 else t0  # room 3: a miss, then room 2
        tokens = [(t0 + 1) % v, (t0 + 3) % v, (t0 + 4) % v, first, x, t2]
        expected = [] if room == 3 else [3, 4, 5] if deep else [3]
        return tokens, TREE, expected[: max(room, 0)]


async def test_a_target_verifying_a_scripted_hubs_trees_equals_generate_alone(
    toy: TorchBackend,
    prompts: list[list[int]],
    references: dict[tuple[int, ...], list[int]],
) -> None:
    """Catches trees verified as chains or not at all (parents lost between the proposal and
    the forward), a DRAFT without Draft.path after a tree or with one after a chain, a path in
    the cropped tree's numbering rather than the hub's, and any token off the target alone's
    greedy output: the toy target through a hub proposing trees (a decoy branch first, the
    target's tokens behind it) produces generate()'s tokens, and every DRAFT names the path
    the hub expects."""
    with TreeHub(references, toy.info.vocab_size) as hub:
        seqs = await _run(hub.endpoint, toy, prompts, PATIENT)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.generated == references[tuple(prompt)]
    assert [h.tree_nodes for h in hub.hellos] == [ANNOUNCED]
    trees = [(s, d) for s, d in hub.answers if s.parents is not None]
    chains = [(s, d) for s, d in hub.answers if s.parents is None]
    assert trees and chains
    for sent, draft in chains:
        assert draft.path is None and draft.accepted == len(sent.expected)
    for sent, draft in trees:
        assert draft.path is not None and draft.path.dtype == np.int32
        assert draft.path.tolist() == sent.expected and draft.accepted == len(sent.expected)
    assert any(s.expected == [3, 4, 5] for s, _ in trees)  # deep paths were taken
    assert any(s.room == 2 and s.expected == [3] for s, _ in trees)  # a cropped tree answered
    assert sum(s.stats.accepted for s in seqs) > 0


# ---------------------------------------------------------------------- hostile trees


def _bad_tree(tokens: list[int], parents: list[int], **fields: Any) -> Any:
    """A proposal hook: every proposal becomes this tree (greedy: no q)."""

    def hook(session: Session, proposal: Proposal) -> Proposal:
        return replace(
            proposal,
            tokens=np.array(tokens, np.int32),
            parents=np.array(parents, np.int32),
            **fields,
        )

    return hook


# (name, hook, the hub's tree offer, the target's announcement (None: its backend's), reason)
_ATTACKS = [
    ("cycle", _bad_tree([10, 11, 12], [1, 0, -1]), 16, None, "node 0 names parent 1"),
    ("forward reference", _bad_tree([10, 11, 12], [-1, 2, 0]), 16, None, "names parent 2"),
    ("parent out of range", _bad_tree([10, 11], [-1, 99]), 16, None, "names parent 99"),
    ("duplicate siblings", _bad_tree([10, 10, 11], [-1, -1, 0]), 16, None, "repeats token 10"),
    ("parents length", _bad_tree([10, 11, 12], [-1, 0]), 16, None, "2 parents for 3"),
    ("over the budget", _bad_tree([10, 11, 12, 13, 14], [-1] * 5), 4, None, "budget of 4"),
    ("to a chains-only target", _bad_tree([10, 11], [-1, 0]), 16, 0, "verifies chains only"),
    (
        "as a pushed branch",
        _bad_tree([10, 11], [-1, -1], if_accepted=0, if_appended=5),
        16,
        None,
        "a token tree sent as a pushed branch",
    ),
]


@pytest.mark.parametrize(
    ("hook", "offered", "announced", "why"),
    [case[1:] for case in _ATTACKS],
    ids=[case[0] for case in _ATTACKS],
)
async def test_a_hostile_hubs_bad_tree_is_refused_and_no_token_is_lost(
    hook: Any,
    offered: int,
    announced: int | None,
    why: str,
    toy: TorchBackend,
    prompts: list[list[int]],
    references: dict[tuple[int, ...], list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches a bad tree verified (or crashing the request: CLI exit 2, HTTP 500) instead of
    refused with its reason: the hub is struck, and every sequence still ends exactly as the
    target alone (generate()), decoded alone or on a re-opened session."""
    strikes: list[str] = []
    strike = HubClient.strike

    def spy(client: HubClient, reason: str) -> None:
        strikes.append(reason)
        strike(client, reason)

    monkeypatch.setattr(HubClient, "strike", spy)
    info = None
    if announced is not None:
        info = TargetInfo("t", toy.info.vocab_size, toy.info.tokenizer_fingerprint, tree_nodes=0)
    attack = Attack("bad-tree", welcome={"tree_nodes": offered}, proposal=hook)
    with FakeHub(attack) as fake:
        seqs = await _run(fake.endpoint, toy, prompts, FAST, info)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.generated == references[tuple(prompt)]
    assert fake.stats["opened"] > 0 and sum(s.stats.rounds for s in seqs) == 0
    assert strikes and all(why in reason for reason in strikes), strikes
