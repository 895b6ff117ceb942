"""jax_cute's version: part of every kernel cache key, so an upgrade never loads a stale kernel."""

__version__ = "0.1.0"
