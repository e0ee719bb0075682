"""chunked_dp: the Elixir/PatrickStar chunk engine for NVLink machines: parameters in chunks
(:mod:`~chunked_dp.chunks`), the rCache that gathers them (:mod:`~chunked_dp.cache`), the search
of chunk size and cache blocks (:mod:`~chunked_dp.search`), the engine (:mod:`~chunked_dp.engine`)
and its worker.  ``--backend chunked`` runs it (:mod:`mobius.backends.chunked`).
"""
