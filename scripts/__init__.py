"""Repository tools by role (scripts/README.md); importable as ``scripts.<role>.<module>``."""
