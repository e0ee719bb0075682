"""The runtime below the commands: what a run decides once (``spec``), its checked inputs
(``inputs``), the training loop every backend shares (``loop``) and the device layer (``device``)."""
