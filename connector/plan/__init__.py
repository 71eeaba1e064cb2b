"""kvtier.connector.plan: what the scheduler side decides a request loads, and when.

`lookups` (each request's lookup off vLLM's scheduler thread: asked again while it runs,
given up past what recomputing the request costs) and `recompute` (what recomputing costs
this engine, learned from its own steps, and the load plan that follows: how much of a hit
to load, and by when). Pure Python: no vLLM, no torch.
"""
