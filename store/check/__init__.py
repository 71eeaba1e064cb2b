"""kvtier.store.check: what `kvtier inspect` reports of a node, and `check` / `gc` of it.

`summary` (what the index says each tier holds), `index` (dead writers' entries, usage
counters), `node` (every tier's own check, repair and garbage collection).
"""
