"""Data-loader position (placeholder; see below)."""
