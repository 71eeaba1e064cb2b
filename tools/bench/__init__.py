"""kvtier.tools.bench: `kvtier bench`: each tier against its physical reference (fio, raw
Mooncake), and real vLLM engines on kvtier against vLLM alone.
"""
