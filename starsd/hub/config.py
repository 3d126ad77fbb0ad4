"""HubConfig: everything ``python -m starsd.hub`` is told, as one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from starsd.hub import auth
from starsd.hub.shapes import TREE_MODES
from starsd.limits import MAX_GAMMA, MAX_TREE_NODES
from starsd.models import FORWARDS

AUTO_START_GAMMA = 4  # --gamma auto: a session's first rounds, until its estimate has data
QUANTIZE_MODES = ("auto", "none", "int8")  # --quantize


@dataclass(frozen=True)
class HubConfig:
    """Everything ``python -m starsd.hub`` is told."""

    model: str
    bind: str = "tcp://127.0.0.1:5555"
    gamma: int | Literal["auto"] = "auto"  # N: every session drafts N (0: none); auto: policy
    max_gamma: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    # an EAGLE head's projections in int8 (starsd/hub/drafters/quantize.py); auto: on a CPU in
    # float32, where PyTorch's dynamic quantization runs
    quantize: str = "auto"
    forward: str = "auto"  # auto: the plain-torch Llama forward where it applies; transformers
    max_sessions: int = 256
    max_sessions_per_target: int = 64
    threads: int = 1
    stats_interval: float = 10.0
    draft_kind: str = "llm"
    target: str | None = None  # EAGLE: the target's directory (embedding, LM head, tokenizer)
    draft_profile: str | None = None  # emulated: the draft profile whose S(B, g) it replays
    heartbeat_s: float = 1.0
    drain_timeout_s: float = 5.0
    curve_secret: str | None = None
    allow_dir: str | None = None
    insecure: bool = False  # allow plain text on a non-loopback bind
    peer_budget: float = 50.0  # messages/s a peer may send besides accepted DRAFTs (0: no limit)
    max_batch: int = 64  # draft jobs drafted together in one batch (1: one at a time)
    gather: bool = True  # a batch waits for the verdicts due within one batch's service time
    predraft_branches: int = 4  # verdicts pre-drafted per session while idle (0: off; llm only)
    # pre-draft only while at most this many proposals are out: with more, the idle gaps are
    # short, few branches hit and a pre-draft step delays the real jobs that arrive meanwhile
    predraft_max_in_flight: int = 2
    # token trees (targets that verify them): auto: the policy picks a chain or a tree size
    # (for every session at once, in phases: starsd/hub/shapes.py); on: always trees of the
    # largest size; off: chains only. The largest tree expands tree_width nodes per depth with
    # tree_width children each, down to tree_depth, at most tree_nodes nodes
    tree: str = "auto"
    tree_width: int = 2
    tree_depth: int = 4
    tree_nodes: int = 8
    metrics_port: int | None = None  # Prometheus /metrics on this port (None: off)
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if (self.draft_kind == "emulated") != (self.draft_profile is not None):
            raise ValueError("draft_kind 'emulated' and draft_profile go together")
        self._check_quantize()
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.forward not in FORWARDS:
            raise ValueError(f"forward must be one of {FORWARDS}, got {self.forward!r}")
        if self.tree not in TREE_MODES:
            raise ValueError(f"tree must be one of {TREE_MODES}, got {self.tree!r}")
        if min(self.tree_width, self.tree_depth, self.tree_nodes) < 1:
            raise ValueError("tree_width, tree_depth and tree_nodes must be >= 1")
        if self.tree_nodes > MAX_TREE_NODES:
            raise ValueError(f"tree_nodes must be at most {MAX_TREE_NODES}")
        if self.predraft_branches < 0:
            raise ValueError(f"predraft_branches must be >= 0, got {self.predraft_branches}")
        if self.predraft_max_in_flight < 1:
            raise ValueError(
                f"predraft_max_in_flight must be >= 1, got {self.predraft_max_in_flight}"
            )
        if not 1 <= self.max_gamma <= MAX_GAMMA:  # a target refuses longer proposals
            raise ValueError(f"max_gamma must be in 1..{MAX_GAMMA}, got {self.max_gamma}")
        if self.gamma != "auto" and (
            isinstance(self.gamma, bool)
            or not isinstance(self.gamma, int)
            or not 0 <= self.gamma <= self.max_gamma
        ):
            raise ValueError(
                f"gamma must be 'auto' or an integer in 0..{self.max_gamma}, got {self.gamma!r}"
            )

    def _check_quantize(self) -> None:
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {self.quantize!r}")
        if self.quantize == "int8" and self.draft_kind not in ("eagle", "eagle3"):
            raise ValueError(
                f"--quantize int8 applies to EAGLE heads; draft kind {self.draft_kind!r} "
                "drafts as loaded"
            )
        if self.quantize == "int8" and not self._int8_runs:
            raise ValueError(
                "--quantize int8 runs on a CPU in float32 (PyTorch's dynamic quantization); "
                f"this hub drafts on {self.device} in {self.dtype}"
            )

    @property
    def _int8_runs(self) -> bool:
        return self.device.split(":")[0] == "cpu" and self.dtype == "float32"

    @property
    def int8_head(self) -> bool:
        """Whether the EAGLE head's projections run in int8 (``--quantize``; auto: where
        PyTorch's dynamic quantization runs)."""
        eagle = self.draft_kind in ("eagle", "eagle3")
        return self.quantize == "int8" or (self.quantize == "auto" and eagle and self._int8_runs)

    @property
    def tree_budget(self) -> int:
        """Nodes of a tree this hub proposes: a tree's nodes count as draft tokens against
        max_gamma (what a target checks a proposal's length against); 0 with --tree off."""
        return 0 if self.tree == "off" else min(self.tree_nodes, self.max_gamma)

    @property
    def auto_gamma(self) -> bool:
        """Whether the hub chooses each session's gamma every round (``--gamma auto``)."""
        return self.gamma == "auto"

    @property
    def default_gamma(self) -> int:
        """What WELCOME announces and an OPEN with gamma 0 gets: the fixed gamma, or under
        auto the gamma sessions start with (4, or max_gamma if smaller)."""
        return min(AUTO_START_GAMMA, self.max_gamma) if self.gamma == "auto" else self.gamma

    @property
    def curve(self) -> auth.CurveServerConfig | None:
        """The CURVE server settings, or None for plain text."""
        if self.curve_secret is None or self.allow_dir is None:
            return None
        return auth.CurveServerConfig(Path(self.curve_secret), Path(self.allow_dir))
