"""kvtier.tools: the `kvtier` command line (`cli`, `commands/`), benchmarks (`bench/`),
replays (`replay/`, `policysim/`), workloads (`workload/`) and the engine driver
(`vllm_engine`). Imports the rest of kvtier; nothing imports it.
"""
