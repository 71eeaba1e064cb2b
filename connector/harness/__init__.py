"""kvtier.connector.harness: vLLM driven from outside, for tests, benchmarks and replays.

`engine_host` (one `LLM` in a process of its own, serving JSON-line commands) and
`gather_bench` (the paged-cache gather and scatter timed on their own). They live under
`connector/` because only it may import vLLM and torch.
"""
