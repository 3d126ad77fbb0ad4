"""The hub's proposers, one module per drafting kind behind :class:`base.Proposer`.

``llm`` (a separate draft LM), ``eagle`` (an EAGLE-1 head on the target's features), ``eagle3``
(an EAGLE-3 head on three of the target's layers), ``null`` (no model work, for overhead
measurements) and ``emulated`` (no model work, paced to a draft profile's S(B, g)).
:mod:`starsd.hub.build` loads the one asked for.
"""

KINDS = ("eagle", "eagle3", "emulated", "llm", "null")
