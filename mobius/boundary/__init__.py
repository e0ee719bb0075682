"""Where a run meets the user's machine: what the user hands us is checked at the door, once
(:mod:`~mobius.boundary.errors`: one line and an exit status, never a traceback;
:mod:`~mobius.boundary.checks`: typed reading of their files), and what we write is provably ours
(:mod:`~mobius.boundary.ownership`: outputs, locks, nothing of theirs replaced;
:mod:`~mobius.boundary.cache`: our measurements between runs; :mod:`~mobius.boundary.janitor`:
temporary directories that go however a process ends)."""
