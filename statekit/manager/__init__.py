"""A run's lifetime (placeholder)."""
