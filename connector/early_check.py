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
the connector checks at construction, as before. The model is checked the same way: a model
kvtier cannot serve (`refusal`) stops the start with one line naming its architecture.
"""

from __future__ import annotations

import sys

_checked: set[int] = set()  # ids of extra configs found valid (vLLM looks up many times)
_DEPTH = 12


def check_lookup() -> None:
    """Validate the extra config of the `KVTransferConfig` a caller is looking us up for,
    and the model of the `VllmConfig` being built around it, if a caller holds one."""
    frame = sys._getframe(2)
    cfg = None
    for _ in range(_DEPTH):
        if frame is None:
            break
        if cfg is None:
            found = frame.f_locals.get("kv_transfer_config")
            if type(found).__name__ == "KVTransferConfig":
                cfg = found
                _check(getattr(cfg, "kv_connector_extra_config", None))
        vllm_config = frame.f_locals.get("self")
        if cfg is not None and type(vllm_config).__name__ == "VllmConfig":
            _refuse(refusal(getattr(vllm_config, "model_config", None),
                            getattr(vllm_config, "cache_config", None)))
            return
        frame = frame.f_back


def refusal(model_config, cache_config=None) -> str | None:
    """Why kvtier cannot serve the model of `model_config` (one line), or None if it can.

    Attention-free models have no KV to store. Models with recurrent state (state-space or
    linear-attention layers beside attention: Jamba, Qwen3-Next, NemotronH, Granite 4.0-H,
    ...) are served with vLLM's prefix caching off (`cache_config.enable_prefix_caching`
    False): kvtier then stores the state a request reaches with its KV, and is the
    engine's prefix cache. With it on (or not yet decided: vLLM's default is on) vLLM keeps
    its own per-block copies of the state, which kvtier does not restore."""
    if model_config is None:
        return None
    try:
        hybrid, free = bool(model_config.is_hybrid), bool(model_config.is_attention_free)
    except AttributeError:  # another vLLM, or a config still being built: checked later
        return None
    archs = getattr(model_config, "architectures", None) or ["this model"]
    if free:
        return (f"kvtier cannot serve {archs[0]}: it has no attention KV; serve it without "
                "the kvtier connector")
    if hybrid and getattr(cache_config, "enable_prefix_caching", None) is not False:
        return (f"kvtier cannot serve {archs[0]} with vLLM's prefix caching on: it keeps "
                "recurrent state (state-space or linear-attention layers) beside its "
                "attention, which kvtier stores itself; serve it with "
                "--no-enable-prefix-caching (kvtier is then its prefix cache)")
    return None


def _check(extra) -> None:
    key = id(extra)
    if key in _checked:
        return
    from kvtier.connector.config import parse_extra_config
    from kvtier.store.base.errors import ConfigError
    try:
        parse_extra_config(extra)
    except ConfigError as e:
        _refuse(str(e), e)
    _checked.add(key)


def _refuse(message: str | None, error: Exception | None = None) -> None:
    """Stop vLLM with `message`: one line and exit code 3 under vLLM's own command line,
    a `ConfigError` in a program that builds `LLM(...)`."""
    if message is None:
        return
    from kvtier.store.base.errors import ConfigError
    if not _vllm_command_line():
        if error is not None:
            raise error
        raise ConfigError(message)
    line = message if message.startswith("kvtier") else f"kvtier: {message}"
    print(line, file=sys.stderr, flush=True)
    raise SystemExit(3) from None


def _vllm_command_line() -> bool:
    """Whether this process is vLLM's own command line (not a program using vLLM)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return name.startswith("vllm.") or sys.argv[0].rsplit("/", 1)[-1] == "vllm"
