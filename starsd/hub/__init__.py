"""The StarSD draft hub: one ROUTER socket, many targets, one work-conserving drafting thread.

    python -m starsd.hub --model DIR --bind tcp://127.0.0.1:5555 [--gamma auto] [--device cuda]

Hub-only code; ``edge/`` never imports anything under this package. Its rooms:

* ``__main__`` - the command line -> :class:`HubConfig`, signals, run.
* ``build`` - load the proposer and assemble a :class:`Hub` (no sockets yet).
* ``server`` - the event loop's side: socket reader, dispatch, leases, replies, drain, reports.
* ``sessions`` - the session table and admission rules, pure (injectable clock, no sockets).
* ``engine`` - the drafting thread's side: the round, Q_in -> plan -> propose -> deliver, send.
* ``scheduler`` - Q_in, fair across targets.  ``drafters/`` - one module per drafting kind.
* ``policy`` - ``--gamma auto``'s rules, pure (``estimates``: what they decide from);
  ``pacing`` - the drafting thread's side of it.  ``predraft`` - branches drafted while idle.

The two threads share the session table and the counters under one lock (``Hub.lock``); a
session's draft state belongs to the drafting thread alone.
"""

from starsd.hub.build import build_hub
from starsd.hub.config import HubConfig
from starsd.hub.server import Hub

__all__ = ["Hub", "HubConfig", "build_hub"]
