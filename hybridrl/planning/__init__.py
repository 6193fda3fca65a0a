"""Capacity planning: what a job needs per GPU before it runs (``hybridrl plan --memory``)."""
