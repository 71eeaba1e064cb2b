"""kvtier.connector: the vLLM KV connector (`KVTierConnector`).

`kv_connector_module_path: kvtier.connector` with `kv_connector: KVTierConnector` loads it.
The class is imported lazily so that the layout and staging modules, which need only torch,
can be used (and tested) without importing vLLM.
"""

from __future__ import annotations

__all__ = ["KVTierConnector"]


def __getattr__(name: str):
    if name == "KVTierConnector":
        from kvtier.connector.early_check import check_lookup
        check_lookup()  # vLLM is building its config: a bad setting stops it now
        from kvtier.connector.connector import KVTierConnector
        return KVTierConnector
    raise AttributeError(f"module 'kvtier.connector' has no attribute {name!r}")
