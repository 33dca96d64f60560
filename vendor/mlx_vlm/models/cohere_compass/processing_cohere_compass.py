"""Torch-free image processor and processor for cohere_compass (placeholder)."""
