"""kvtier.tools.workload: the workloads the replays serve: recorded traces and the synthetic
agentic workload.
"""
