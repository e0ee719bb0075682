"""The runtime below the commands: the run's checked inputs (``inputs``), the training loop every
backend shares (``loop``) and the device layer (``device``).  What a run decides once is
:mod:`mobius.spec`, above it."""
