"""The package version, in a module of its own: what reads it (the CLI, the node agent's
handshake, checkpoint metadata) imports this, not the package root."""

__version__ = "0.1.0"
