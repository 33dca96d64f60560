"""Helpers of the test suite; test files import them, never each other.

Code that scripts use too (driving a model for parity, mlx-vlm runs as a host makes them,
quantized folders, the recorded reference read back, the host-sync guard, the recorders' case
tables) lives in ``scripts/_lib``, which tests may import; nothing in ``scripts/`` imports tests.
"""
