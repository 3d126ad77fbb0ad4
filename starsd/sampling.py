"""Sampling and lossless verification, pure torch, shared by the hub (q) and the edge (p).

Terms: p is the target's distribution, q the draft's; gamma draft tokens are verified with
gamma + 1 target positions (the last one gives the bonus token). Logit processing follows
transformers' logits warpers exactly (temperature, then top-k, then top-p), so both sides and a
plain ``generate()`` agree on what "the target's distribution" is.

Verification is Leviathan et al. / Chen et al. speculative sampling: draft token d_i is accepted
with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the replacement is drawn from
the residual norm(max(p_i - q_i, 0)); when all gamma are accepted a bonus token is drawn from
p_{gamma+1}. The emitted tokens are then distributed exactly as sampling from p alone.

That guarantee holds only if each d_i was drawn from the q row sent with it, so q is checked
before it is used (:func:`q_problem`): finite, in [0, 1], each row summing to 1 and positive at
its draft token. A q that fails any of these cannot be the law a token was drawn from; one that
passes but lies (the tokens drawn from another law) is beyond any check of a single proposal.
"""

from __future__ import annotations

import torch

from starsd import tree
from starsd.protocol import SamplingParams


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded with ``seed`` (or from OS entropy when None)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to ``logits`` [..., V]; removed entries become -inf."""
    scores = logits.float() / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= 1.0 - params.top_p
        remove_sorted[..., -1] = False  # keep at least one token, like min_tokens_to_keep=1
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution [..., V] float32 for non-greedy ``params``.

    The logits are shifted so that each row's largest is 0 before dividing by the temperature:
    softmax is shift-invariant, but unshifted a large |logit| / temperature overflows float32 to
    inf and the softmax to NaN. Shifted, every score is <= 0 (at worst -inf, probability 0) and
    the top one is exactly 0, so the row stays finite and normalised for any finite logits and
    any temperature ``SamplingParams.validate`` accepts. (At temperature 1 the result is
    bit-identical to the unshifted one: softmax subtracts the same max itself.)
    """
    logits = logits.float()
    top = logits.amax(dim=-1, keepdim=True)
    shifted = logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return process_logits(shifted, params).softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of ``probs`` [B, V] -> token ids [B] (int64)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Greedy argmax or one sample from the processed distribution of ``logits`` [V]."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(sample(probs_from_logits(logits[None], params), generator)[0])


def greedy_verify(draft_tokens: torch.Tensor, p_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification of ``draft_tokens`` [gamma] against ``p_logits`` [gamma + 1, V].

    Returns (accepted count, next token): the target's argmax at the first disagreement, or the
    bonus argmax after all gamma are accepted.
    """
    p_argmax = torch.argmax(p_logits, dim=-1)  # [gamma + 1]
    gamma = draft_tokens.shape[0]
    mismatch = (p_argmax[:gamma] != draft_tokens).nonzero()
    accepted = int(mismatch[0, 0]) if mismatch.numel() else gamma
    return accepted, int(p_argmax[accepted])


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) over the last dim; falls back to p where the residual is empty."""
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)


Q_SUM_TOLERANCE = 1e-3  # |sum(q row) - 1|: float16 rounding of every entry stays within it


def q_problem(draft_tokens: torch.Tensor, q_probs: torch.Tensor) -> str | None:
    """Why ``q_probs`` [gamma, V] cannot be the law ``draft_tokens`` [gamma] were drawn from
    (None if it can): a non-finite entry, an entry outside [0, 1], a row that does not sum to 1
    (within ``Q_SUM_TOLERANCE``), or zero probability at the row's draft token."""
    q = q_probs.float()
    if not bool(torch.isfinite(q).all()):
        return "q has a NaN or infinite entry"
    if bool((q < 0).any()) or bool((q > 1 + Q_SUM_TOLERANCE).any()):
        return f"q has an entry outside [0, 1] (min {float(q.min()):g}, max {float(q.max()):g})"
    sums = q.sum(dim=-1)  # [gamma]
    worst = int((sums - 1).abs().argmax()) if sums.numel() else 0
    if sums.numel() and abs(float(sums[worst]) - 1) > Q_SUM_TOLERANCE:
        return f"q row {worst} sums to {float(sums[worst]):.6g}, not 1"
    at_draft = q.gather(-1, draft_tokens.long().unsqueeze(-1)).squeeze(-1)  # [gamma]
    if bool((at_draft <= 0).any()):
        return f"q is 0 at draft token {int((at_draft <= 0).nonzero()[0, 0])}"
    return None


def rejection_sample(
    draft_tokens: torch.Tensor,
    q_probs: torch.Tensor,
    p_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched speculative sampling.

    draft_tokens [B, gamma] int64, q_probs [B, gamma, V], p_probs [B, gamma + 1, V].
    Returns (accepted [B] int64 in 0..gamma, next_token [B] int64): the first ``accepted[b]``
    draft tokens are kept and ``next_token[b]`` follows them (residual sample or bonus).
    Raises ValueError for a q row that :func:`q_problem` refuses.
    """
    batch, gamma = draft_tokens.shape
    for b in range(batch):
        problem = q_problem(draft_tokens[b], q_probs[b])
        if problem is not None:
            raise ValueError(problem)
    idx = draft_tokens.unsqueeze(-1)  # [B, gamma, 1]
    p_d = p_probs[:, :gamma].gather(-1, idx).squeeze(-1)  # [B, gamma]
    q_d = q_probs.gather(-1, idx).squeeze(-1)  # [B, gamma]
    u = torch.rand(batch, gamma, generator=generator, device=p_probs.device)
    ok = u * q_d < p_d  # u < p/q without dividing by a tiny q; a q_d of 0 is never accepted
    # accepted = length of the all-true prefix of ok
    accepted = ok.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    rows = torch.arange(batch, device=p_probs.device)
    at = accepted.clamp_max(gamma - 1) if gamma > 0 else accepted
    q_padded = torch.cat([q_probs, torch.zeros_like(p_probs[:, :1])], dim=1)  # [B, gamma+1, V]
    replacement = residual_distribution(p_probs[rows, at], q_padded[rows, at])  # [B, V]
    bonus = p_probs[rows, accepted]  # [B, V]
    final = torch.where((accepted == gamma).unsqueeze(-1), bonus, replacement)
    return accepted, sample(final, generator)


def dense_q(q_probs: torch.Tensor, q_support: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Expand q sent as (support [gamma, K], probs [gamma, K]) to dense [gamma, V] float32."""
    if q_support is None:
        return q_probs.float()
    dense = torch.zeros(q_probs.shape[0], vocab_size, dtype=torch.float32)
    dense.scatter_add_(-1, q_support.long(), q_probs.float())
    return dense


def sparse_q(q_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress q [gamma, V] with truncated support to (support [gamma, K] int32, probs [gamma, K]).

    K is the largest support of any row; shorter rows are padded with token 0 at probability 0.
    """
    k = max(int((q_probs > 0).sum(dim=-1).max()), 1)
    probs, support = torch.topk(q_probs, k, dim=-1)  # [gamma, K]
    return support.to(torch.int32), probs.float()


# ---------------------------------------------------------------------- token trees
#
# Trees as :mod:`starsd.tree` lays them out: rows of p (and q) indexed by node + 1, row 0 the
# root's, the distribution of the token after that node's path.
#
# Sampled trees use recursive rejection sampling without replacement (RSD, Jeon et al. 2024):
# the children of a node are drawn from its q row without replacement (:func:`draw_children`),
# so the i-th child is a draw from q with the earlier siblings removed and renormalised, q_i.
# Verification walks from the root: child c_i of the current node is accepted with probability
# min(1, p_i(c_i) / q_i(c_i)); on rejection p_{i+1} = norm(max(p_i - q_i, 0)) (the residual,
# exactly the one-draft rule's) and the next sibling is tried; an accepted child becomes the
# current node (its own p and q rows); when every child is rejected, or the node has none, the
# next token is drawn from the current p_i (the last residual, or the node's p: the bonus).
# Each step is the one-draft rule applied to p_i with a proposal drawn from q_i independently
# of the earlier coins, so the emitted tokens follow p exactly. Chosen over SpecInfer's
# multi-step rule (children drawn with replacement from q) because without replacement no two
# siblings repeat a token, so a node budget buys distinct guesses.


def draw_children(q_row: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct tokens from ``q_row`` [V], drawn one after another without replacement
    (Gumbel top-k: the order of the perturbed log-probabilities is that of sequential draws),
    at most as many as q's support; int64 [count'] in drawing order."""
    count = min(count, int((q_row > 0).sum()))
    u = torch.rand(q_row.shape, generator=generator, device=q_row.device).clamp_min(1e-20)
    keys = q_row.float().log() - (-u.log()).log()  # log q + Gumbel noise; -inf where q is 0
    return torch.topk(keys, count).indices


def greedy_tree_verify(
    tokens: list[int], parents: list[int], p_logits: torch.Tensor
) -> tuple[list[int], int]:
    """The longest root path whose every token is the target's argmax given its prefix, and
    the target's token after it. ``p_logits`` [N + 1, V] (row 0 the root's). Returns (the
    path's nodes, next token)."""
    argmax = torch.argmax(p_logits, dim=-1).tolist()  # [N + 1]
    kids, row = tree.children(parents), 0
    path: list[int] = []
    while True:
        match = next((c for c in kids[row] if tokens[c] == argmax[row]), None)
        if match is None:
            return path, int(argmax[row])
        path.append(match)
        row = match + 1


def tree_rejection_sample(
    tokens: list[int],
    parents: list[int],
    q_rows: torch.Tensor,
    p_rows: torch.Tensor,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """Recursive rejection sampling over a tree (the section's comment): ``q_rows`` and
    ``p_rows`` [N + 1, V] float32 (row 0 the root's; a row without children is not read from
    q). Returns (the accepted path's nodes, the next token)."""
    kids, row = tree.children(parents), 0
    path: list[int] = []
    while True:
        p, q = p_rows[row], q_rows[row]
        accepted = None
        for child in kids[row]:
            token = tokens[child]
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * float(q[token]) < float(p[token]):  # u < p / q without dividing
                accepted = child
                break
            p = residual_distribution(p, q)
            q = _without(q, token)
        if accepted is None:
            return path, int(sample(p[None], generator)[0])
        path.append(accepted)
        row = accepted + 1


def _without(q: torch.Tensor, token: int) -> torch.Tensor:
    """q with ``token`` removed and renormalised (the law of the next sibling's draw)."""
    q = q.clone()
    q[token] = 0.0
    mass = q.sum()
    return q / mass if float(mass) > 0 else q
