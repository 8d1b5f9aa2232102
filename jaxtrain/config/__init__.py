"""The configuration layer: the names each setting may take (tables.py), the checks of every
field (checks.py) and the frozen per-subsystem sections a run is read through (sections.py).

It imports nothing of the implementation (no jax, flax or optax): the command line parses and
checks a whole configuration before anything heavy is imported, and each table of names has
one home here that the implementation reads too.
"""
