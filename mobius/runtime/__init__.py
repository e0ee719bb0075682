"""The runtime below the commands: the run's checked inputs (``inputs``), the training loop every
backend shares (``loop``) with its optimizer (``optim``), a worker process whatever its backend (``worker``), checkpoints
(``checkpoint``), the device layer (``device``), emulated PCIe boxes (``emulation``) and what a run
executes as plain data (``spec``: the plan, the chunked setup and the
:class:`~mobius.runtime.spec.RunSpec`).  Deciding that spec is :mod:`mobius.planning.prepare` and
:mod:`chunked_dp.prepare`, above it."""
