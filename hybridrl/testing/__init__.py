"""Helpers for testing distributed code on CPU (gloo ranks in local processes)."""
