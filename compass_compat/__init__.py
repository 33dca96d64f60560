"""compass-compat: cohere_compass for mlx-vlm releases that predate it."""
