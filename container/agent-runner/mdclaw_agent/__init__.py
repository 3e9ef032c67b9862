"""The mdclaw agent runner: the program inside every agent container.

It reads one ContainerInput JSON document on stdin, runs the conversation with the configured
model backend, prints each result between output markers on stdout, and acts on the world only
by writing command files into its IPC folder. It never holds a secret: the model API is reached
through the host's credential proxy (a unix socket in the IPC folder) with a placeholder key.
"""

__version__ = "0.1.0"
