"""Helpers of the test suite; test files import them, never each other.

The recorders and benchmarks under ``scripts/`` import them too (driving a model for parity, mlx-vlm
runs as a host makes them, the recorded reference read back, the recorders' case tables); nothing
here imports ``scripts/``, and nothing else under ``tests/`` is imported from ``scripts/``.
"""
