"""``python -m starsd.analytic``: see :mod:`starsd.analytic.cli`."""

from starsd.analytic.cli import main

main()
