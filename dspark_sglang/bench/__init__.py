"""Benchmarks and load generators; CLIs run as `python -m dspark_sglang.bench.<name>`."""
