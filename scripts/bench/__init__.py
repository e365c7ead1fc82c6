"""Benchmarks: each prints ratios measured side by side in one run (docs/BENCHMARKS.md records them)."""
