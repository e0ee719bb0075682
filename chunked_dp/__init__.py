"""chunked_dp: the Elixir/PatrickStar chunk engine for NVLink machines.

Not built yet: ``--backend chunked`` exits with status 2 saying so.
"""
