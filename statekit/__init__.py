"""statekit: a plugin-based checkpoint and training-state manager for PyTorch."""

from __future__ import annotations

__version__ = "0.1.0"
