"""The connector's settings checked the moment vLLM first looks the connector up.

vLLM builds the connector a minute or more into its start (after loading the model and
warming it up), so a mistake in `kv_connector_extra_config` used to surface only then, in
every process, as pages of tracebacks. But vLLM looks the connector class up much earlier,
while it builds its configuration, a second after start, in the process the user started
(`KVConnectorFactory.get_connector_class(kv_transfer_config)`, asking whether it supports
the hybrid memory allocator). `check_lookup` finds that `kv_transfer_config` among its
callers' locals and validates its extra config then (`parse_extra_config`: fields, the
policy file, the policy), so a bad setting stops vLLM right there: under vLLM's own command
line (`vllm serve`, `python -m vllm.entrypoints...`) with kvtier's one-line message and exit
code 3, no traceback; in a program that builds `LLM(...)` as the `ConfigError` it can catch.
Where no such caller is found (another vLLM, another caller), nothing is checked here and
the connector checks at construction, as before.
"""

from __future__ import annotations

import sys

_checked: set[int] = set()  # ids of extra configs found valid (vLLM looks up many times)
_DEPTH = 12


def check_lookup() -> None:
    """Validate the extra config of the `KVTransferConfig` a caller is looking us up for."""
    frame = sys._getframe(2)
    for _ in range(_DEPTH):
        if frame is None:
            return
        cfg = frame.f_locals.get("kv_transfer_config")
        if type(cfg).__name__ == "KVTransferConfig":
            _check(getattr(cfg, "kv_connector_extra_config", None))
            return
        frame = frame.f_back


def _check(extra) -> None:
    key = id(extra)
    if key in _checked:
        return
    from kvtier.connector.config import parse_extra_config
    from kvtier.store.base.errors import ConfigError
    try:
        parse_extra_config(extra)
    except ConfigError as e:
        if not _vllm_command_line():
            raise
        print(f"kvtier: {e}", file=sys.stderr, flush=True)
        raise SystemExit(3) from None
    _checked.add(key)


def _vllm_command_line() -> bool:
    """Whether this process is vLLM's own command line (not a program using vLLM)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return name.startswith("vllm.") or sys.argv[0].rsplit("/", 1)[-1] == "vllm"
