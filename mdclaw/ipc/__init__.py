"""The IPC engine: agent command files in, state changes and host files out."""
