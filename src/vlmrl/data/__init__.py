"""Data rows in: reading and validating dataset files, images and videos, the built-in synthetic tasks."""
