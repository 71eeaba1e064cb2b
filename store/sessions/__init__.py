"""kvtier.store.sessions: agent sessions inferred from block keys, and their predictions.

`tracker` (which request continues which session), `stats` and `gap_shape` (what the gaps
between turns look like), `predict` (when a session comes back), `persist` (sessions as the
index keeps them, for `inspect` and `gc`). Pure logic but `persist`.
"""
