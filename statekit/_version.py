"""The statekit version, in a leaf module so any module can import it without a cycle
through the package facade."""

__version__ = "0.1.0"
