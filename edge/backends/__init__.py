"""Verifier backends: the model runtimes a target verifies with (see :mod:`edge.backends.base`)."""
