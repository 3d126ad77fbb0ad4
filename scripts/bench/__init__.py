"""The benchmark harness and its suites (``python -m scripts.bench.run --suite ...``)."""
