"""mdclaw: a self-hosted personal AI assistant host."""

__version__ = "0.1.0"
