"""kvtier.tools.replay: `kvtier replay --engine vllm|sim`, the main job: real (or simulated)
engines on kvtier serving a workload, with its plan, routing, metrics, report and targets.
"""
