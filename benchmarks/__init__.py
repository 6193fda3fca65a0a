"""Benchmarks: each prints the measured side and its baseline side by side with their ratio."""
