"""Emulated targets: the real protocol to the real hub, with the target forward replaced.

    python -m scripts.emulate.emulated --hub tcp://HOST:5555 --model TARGET_DIR --targets 64 \
        --alpha 0.7 --verify-ms 5 --duration 5 --out emulated.json

Each emulated target is its own DEALER connection with one sequence in flight. Instead of a
target forward it waits ``--verify-ms`` (without blocking the loop) and draws the number of
accepted tokens from an i.i.d. acceptance process with rate ``--alpha`` (seeded), so one process
can stand in for far more targets than the machine could run as real models. The hub drafts for
real. ``--gamma 0`` opens every session with gamma 0, the hub's choice (``--gamma auto``): a
PROPOSAL with no tokens and ``alone`` = K is then honoured as a real target does, by decoding K
tokens alone (a wait of K standalone steps, ``--alone-step-ms``, random tokens) and sending them
in one DRAFT with accepted 0. ``--verify-ms-per-token`` makes the verify time grow with the
proposal (``--verify-ms`` + that per draft token), so that longer drafts cost the target what
they cost a real one. ``--alpha-switch A --switch-at F`` changes the acceptance rate to A once F
of the run after the warm-up has passed, and ``--trace-gamma`` (implied by a switch) records
every session's proposal lengths round by round (``gamma_trace``). ``--tree-nodes K`` announces
token trees of up to K nodes in HELLO: a tree is verified in the verify time of its node count
and its accepted path drawn as :mod:`scripts.emulate.acceptance` says (``--sibling-alpha``).

Two drivers run the same targets (:mod:`scripts.emulate.rounds`, one report): with one hub, by
default, one ZeroMQ poller (:mod:`scripts.emulate.poller`: about half the CPU a round, so the
load generator's own serial cost stays small beside a round); with ``--driver asyncio``, or
several hubs, the target's own asyncio hub clients.

``--hub`` takes a comma list of hubs: each emulated target then keeps one connection per hub
(an edge.hubs.HubPool, as a real target given ``--hub A,B``) and opens each sequence on
``pool.pick()`` after ``pool.refresh()``, as a real target does; the report then
adds ``hubs`` (per hub: sessions placed there, its open sessions, busy fraction, jobs and batch
size over the window) and ``balance``, and its hub-wide figures pool every hub's counters.

The report carries system and per-target throughput, per-token latency, bytes per round,
each round's wait for its proposal (DRAFT sent to PROPOSAL received: the hub's queue wait and
service plus the link), and from STATS replies over the measured window the hub's busy fraction,
mean batch size and, when the hub counts them, its service time per batch size S(B).

After the warm-up, calibration slices alternate with the measured window's slices (so this
machine's drifting speed hits both alike): the hub's draft service time S(d) and the emulated
verify time measured in the calibration slices, at the same N but outside the window, are the
inputs from which the benchmark predicts the window's throughput (scripts/bench/scale_report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import replace

from edge.client import HubClient
from edge.handshake import TargetInfo
from edge.hubs import HubPool, parse_hub_endpoints
from scripts.emulate.config import EmulationConfig, Phases, schedule, switch_time
from scripts.emulate.poller import emulate_polled
from scripts.emulate.report import TargetRecord, full_report
from scripts.emulate.rounds import SequenceRounds, new_trace
from starsd import protocol, transport
from starsd.profile import ProfileError, load_profile
from starsd.protocol import SamplingParams, Stats

PROMPT_TOKENS = 16
WARMUP_LIMIT_S = 60.0
CLOSE_FLUSH_S = 0.2


async def run_target(
    pool: HubPool,
    cfg: EmulationConfig,
    index: int,
    phases: Phases,
    record: TargetRecord,
) -> None:
    """One emulated target: sequences back to back until the last slice ends, each opened on
    the hub ``pool.pick()`` places it on (with one hub: that hub)."""
    rng = random.Random(cfg.seed * 100_003 + index)
    while time.perf_counter() < phases.finish:
        await pool.refresh()
        client = pool.pick()
        if client is None:  # a benchmark with a hub down measures nothing worth keeping
            raise RuntimeError(f"target {index}: no live hub to open a session on")
        record.placed[client.endpoint] = record.placed.get(client.endpoint, 0) + 1
        prompt = [rng.randrange(client.info.vocab_size) for _ in range(PROMPT_TOKENS)]
        tag, inbox = await client.open(prompt, SamplingParams(), cfg.gamma)
        trace = new_trace(index, phases) if cfg.tracing else None
        if trace is not None:
            record.traces.append(trace)
        await _one_sequence(client, cfg, rng, tag, inbox, phases, record, trace)
        await client.close_session(tag)


async def _one_sequence(
    client: HubClient,
    cfg: EmulationConfig,
    rng: random.Random,
    tag: bytes,
    inbox: asyncio.Queue[protocol.Message],
    phases: Phases,
    record: TargetRecord,
    trace: dict | None = None,
) -> None:
    vocab = client.info.vocab_size
    rounds = SequenceRounds(cfg, rng, vocab, phases, record, client.endpoint, trace)
    while rounds.wants_more():
        msg = await _next_message(inbox, phases)
        if msg is None:  # the run ended while the hub was still drafting it: stop waiting
            return
        ans = rounds.take(msg)
        if ans is None:
            return
        await asyncio.sleep(ans.wait_s)
        seq = rounds.settle(ans)
        await client.draft(
            tag, seq, ans.accepted, ans.appended, path=ans.path, forward_s=ans.forward_s
        )


async def _next_message(
    inbox: asyncio.Queue[protocol.Message], phases: Phases
) -> protocol.Message | None:
    """The session's next message, or None once the last slice has ended (the caller then
    closes the session, so the hub drops its queued job instead of drafting it into the next
    run)."""
    if math.isinf(phases.finish):  # warm-up: the schedule is not set yet
        return await inbox.get()
    try:
        return await asyncio.wait_for(inbox.get(), max(0.0, phases.finish - time.perf_counter()))
    except asyncio.TimeoutError:
        return None


async def emulate(cfg: EmulationConfig) -> dict:
    """Run the emulation and return its report (also written to ``cfg.out``)."""
    ctx = transport.new_context()
    info, endpoints = target_info(cfg), cfg.endpoints
    pools = [HubPool.create(ctx, endpoints, info) for _ in range(cfg.targets)]
    try:
        await asyncio.gather(*(pool.connect() for pool in pools))
        phases, records = Phases(), [TargetRecord() for _ in pools]
        tasks = [
            asyncio.create_task(run_target(pool, cfg, i, phases, records[i]))
            for i, pool in enumerate(pools)
        ]
        await _warm_up(cfg, phases, tasks)
        phases.switch = switch_time(phases.bounds, cfg)
        snapshots, cpu = await _poll_stats(phases, _stats_clients(pools[0], endpoints))
        await asyncio.gather(*tasks)
        await asyncio.sleep(CLOSE_FLUSH_S)  # the sockets close with linger 0: let CLOSEs out
    finally:
        await asyncio.gather(*(pool.aclose() for pool in pools))
        ctx.term()
    return full_report(cfg, records, snapshots, cpu)


def _stats_clients(pool: HubPool, endpoints: tuple[str, ...]) -> list[HubClient]:
    """One client per hub, in ``--hub`` order, to ask for STATS (the first target's)."""
    by_endpoint = {client.endpoint: client for client in pool.clients}
    return [by_endpoint[endpoint] for endpoint in endpoints]


async def _poll_stats(
    phases: Phases, clients: list[HubClient]
) -> tuple[list[list[Stats]], list[tuple[float, float]]]:
    """Every hub's STATS at every slice bound (one list per hub), and this process's
    (wall, CPU) clock there."""
    snapshots: list[list[Stats]] = [[] for _ in clients]
    cpu = []
    for bound in phases.bounds:
        await asyncio.sleep(max(0.0, bound - time.perf_counter()))
        replies = await asyncio.gather(*(client.stats() for client in clients))
        for per_hub, reply in zip(snapshots, replies, strict=True):
            per_hub.append(reply)
        cpu.append((time.perf_counter(), time.process_time()))
    return snapshots, cpu


def target_info(cfg: EmulationConfig) -> TargetInfo:
    """What the emulated targets claim in HELLO: given, or read from the model directory."""
    if cfg.vocab_size and cfg.tokenizer:
        return TargetInfo("emulated", cfg.vocab_size, cfg.tokenizer, tree_nodes=cfg.tree_nodes)
    from starsd import models  # torch and transformers: seconds, only when asked to read

    info = models.load_tokenizer_info(cfg.model or models.TOY_TARGET_DIR)
    return TargetInfo(
        "emulated", info.vocab_size, info.tokenizer_fingerprint, tree_nodes=cfg.tree_nodes
    )


async def _warm_up(cfg: EmulationConfig, phases: Phases, tasks: list[asyncio.Task]) -> None:
    """Wait ``cfg.warmup`` and until every target has had a proposal, then set the phases."""
    started = time.perf_counter()
    while phases.first_proposals < cfg.targets or time.perf_counter() - started < cfg.warmup:
        failed = next((t for t in tasks if t.done()), None)
        if failed is not None:
            failed.result()  # its error; a target never ends before the window does
        if time.perf_counter() - started > cfg.warmup + WARMUP_LIMIT_S:
            raise RuntimeError(
                f"{phases.first_proposals} of {cfg.targets} targets had a "
                f"proposal after {WARMUP_LIMIT_S:.0f} s"
            )
        await asyncio.sleep(0.01)
    phases.bounds = schedule(time.perf_counter(), cfg)


def parse_args(argv: list[str] | None = None) -> EmulationConfig:
    """argparse -> EmulationConfig."""
    p = argparse.ArgumentParser(
        prog="python -m scripts.emulate.emulated", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--hub",
        required=True,
        help="hub endpoint, or a comma list: each target places sessions over them",
    )
    p.add_argument("--targets", type=int, default=EmulationConfig.targets)
    p.add_argument("--alpha", type=float, default=EmulationConfig.alpha)
    p.add_argument("--verify-ms", type=float, default=EmulationConfig.verify_ms)
    p.add_argument(
        "--gamma",
        type=int,
        default=EmulationConfig.gamma,
        help="the gamma each OPEN names; 0: the hub's choice (its --gamma auto)",
    )
    p.add_argument(
        "--verify-ms-per-token",
        type=float,
        default=EmulationConfig.verify_ms_per_token,
        help="verify time grows by this per draft token (--verify-ms + it * gamma)",
    )
    p.add_argument(
        "--alone-step-ms",
        type=float,
        default=EmulationConfig.alone_step_ms,
        help="one token decoded alone (gamma 0 spans); 0: --verify-ms",
    )
    p.add_argument(
        "--alpha-switch",
        type=float,
        default=EmulationConfig.alpha_switch,
        help="the acceptance rate from --switch-at of the run on",
    )
    p.add_argument(
        "--switch-at",
        type=float,
        default=EmulationConfig.switch_at,
        help="fraction of the run after the warm-up at which alpha switches",
    )
    p.add_argument(
        "--trace-gamma",
        action="store_true",
        help="record each session's proposal lengths round by round",
    )
    p.add_argument("--duration", type=float, default=EmulationConfig.duration)
    p.add_argument("--warmup", type=float, default=EmulationConfig.warmup)
    p.add_argument(
        "--calibration",
        type=float,
        default=EmulationConfig.calibration,
        help="seconds (in all) in which S(d) and verify time are measured",
    )
    p.add_argument(
        "--slices",
        type=int,
        default=EmulationConfig.slices,
        help="window slices, alternating with slices + 1 calibration slices",
    )
    p.add_argument("--max-new-tokens", type=int, default=EmulationConfig.max_new_tokens)
    p.add_argument("--seed", type=int, default=EmulationConfig.seed)
    p.add_argument("--model", default=EmulationConfig.model, help="target dir (tokenizer only)")
    p.add_argument("--vocab-size", type=int, default=EmulationConfig.vocab_size)
    p.add_argument(
        "--tokenizer",
        default=EmulationConfig.tokenizer,
        help="tokenizer fingerprint; with --vocab-size, --model is not read",
    )
    p.add_argument(
        "--profile",
        default="",
        help="a target profile (starsd profile target): verify of g tokens takes its V(1, g), "
        "a token decoded alone its T(1) (overrides --verify-ms and --alone-step-ms)",
    )
    p.add_argument(
        "--tree-nodes",
        type=int,
        default=EmulationConfig.tree_nodes,
        help="announce token trees of up to this many nodes (0: chains only)",
    )
    p.add_argument(
        "--sibling-alpha",
        type=float,
        default=EmulationConfig.sibling_alpha,
        help="in a tree, the chance each next child holds the token its elder siblings missed",
    )
    p.add_argument(
        "--driver",
        choices=("auto", "poll", "asyncio"),
        default=EmulationConfig.driver,
        help="poll: one ZeroMQ poller, a fraction of the CPU a round (one hub); asyncio: the "
        "target's own hub clients (several hubs); auto: poll for one hub",
    )
    p.add_argument("--out")
    args = p.parse_args(argv)
    try:
        if len(parse_hub_endpoints(args.hub)) > 1 and args.driver == "poll":
            p.error("--driver poll drives one hub; several hubs need --driver asyncio")
        return with_profile(EmulationConfig(**vars(args)))
    except ValueError as exc:  # (ProfileError is one)
        p.error(f"--hub: {exc}" if not isinstance(exc, ProfileError) else str(exc))


def with_profile(cfg: EmulationConfig) -> EmulationConfig:
    """``cfg`` with its target profile's times (unchanged without one): V(1, g) per gamma,
    T(1) alone, and --verify-ms as V(1, smallest gamma) for the reports."""
    if not cfg.profile:
        return cfg
    target = load_profile(cfg.profile, "target")
    points = target.along_gamma("verify_ms")
    step_ms = 1e3 * target.seconds("step_ms")[(1, 0)]
    return replace(cfg, verify_points=points, alone_step_ms=step_ms, verify_ms=1e3 * points[0][1])


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m scripts.emulate.emulated``."""
    cfg = parse_args(argv)
    result = (
        emulate_polled(cfg, target_info(cfg)) if cfg.polled else transport.run_loop(emulate(cfg))
    )
    text = json.dumps(result, indent=2)
    if cfg.out:
        with open(cfg.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
