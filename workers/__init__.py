"""Compute: torch + transformers, no ray at import time (runtime/ wraps these classes)."""
