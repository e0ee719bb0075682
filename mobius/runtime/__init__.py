"""The runtime below the commands: the run's checked inputs (``inputs``), the training loop every
backend shares (``loop``), the device layer (``device``) and what a run executes as plain data
(``spec``: the plan and the :class:`~mobius.runtime.spec.RunSpec`).  Deciding that spec is
:mod:`mobius.prepare`, above it."""
