"""The runtime below the commands: the device layer (streams, events, host buffers)."""
