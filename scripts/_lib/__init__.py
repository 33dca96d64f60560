"""Code shared by the scripts (and importable by the tests); nothing here imports tests/."""
