"""Benchmarks of the engine backends, runnable with numpy (+ cupy) alone."""
