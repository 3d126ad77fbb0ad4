"""Tools around the product: benchmarks, emulation, hostile-peer probes, model training, demo."""
