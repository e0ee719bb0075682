"""What a run decides before its first step, and again where it finds a decision wrong:
:mod:`~mobius.planning.prepare` (topology, devices, precision, profile: decided once, into the
run's spec), :mod:`~mobius.planning.planner` (the plan: partition, mapping, placement, from a
profile given as data) and :mod:`~mobius.planning.replan` (a plan made again mid-run from what
the run measured)."""
