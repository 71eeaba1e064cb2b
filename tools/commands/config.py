"""`kvtier config check|show`: validate a policy (and the vLLM side) before anything starts.

`check` does in about a second what a vLLM engine would otherwise find out a minute into its
start: the policy's fields, its paths on this machine (each a directory this user can write,
with room for its capacity), and with `--kv-transfer-config` the connector's settings
(`kv_connector_extra_config`) and `chunk_tokens` against vLLM's block size. `show` prints the
resolved policy as a policy file writes it. Results go to stdout (valid YAML or JSON), the
verdict and problems to stderr. Exit codes: 0 fine, 3 invalid (the problems are listed),
2 a usage mistake.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

import typer
import yaml

from kvtier.store.base.config import Policy, load_policy
from kvtier.store.base.config_dump import policy_as_written
from kvtier.store.base.errors import ConfigError
from kvtier.store.check.preflight import preflight

app = typer.Typer(rich_markup_mode=None, no_args_is_help=True, help="Validate and print tier policies.")
INVALID = 3
VLLM_DEFAULT_BLOCK_SIZE = 16  # vLLM's CacheConfig default; MLA on the CPU build uses 16 too


@app.command("check")
def check(file: Optional[Path] = typer.Argument(
              None, help="policy YAML file (default: the built-in policy, or the one the "
                         "--kv-transfer-config names)"),
          kv_transfer_config: Optional[str] = typer.Option(
              None, "--kv-transfer-config", metavar="JSON",
              help="vLLM's --kv-transfer-config, as given to vllm serve (or @FILE)"),
          block_size: int = typer.Option(VLLM_DEFAULT_BLOCK_SIZE, "--block-size", min=1,
                                         help="vLLM's --block-size"),
          as_json: bool = typer.Option(False, "--json", help="print the policy as JSON")
          ) -> None:
    """Check a policy and, with --kv-transfer-config, the connector settings; print the
    resolved policy. Exit code 3 when anything is wrong (each problem on its own line)."""
    policy, notes = _checked_policy(file, kv_transfer_config, block_size)
    problems = notes + preflight(policy)
    errors = [p for p in problems if not p.startswith("warning:")]
    for line in problems:
        print(f"{policy.source}: {line}", file=sys.stderr)
    _print(policy, as_json)
    if errors:
        raise typer.Exit(INVALID)
    print(f"ok {policy.source}", file=sys.stderr)


@app.command("show")
def show(file: Optional[Path] = typer.Argument(None, help="policy file (default: built in)"),
         as_json: bool = typer.Option(False, "--json", help="print the policy as JSON")) -> None:
    """Print the resolved policy (the embedded default when no FILE is given): every field
    under the name a policy file uses, defaults filled in, paths absolute."""
    _print(load_policy(file), as_json)


def _print(policy: Policy, as_json: bool) -> None:
    if as_json:
        print(json.dumps(policy_as_written(policy, human=False), indent=2))
    else:
        print(yaml.safe_dump(policy_as_written(policy), sort_keys=False), end="")


def _checked_policy(file: Optional[Path], transfer: Optional[str], block_size: int
                    ) -> tuple[Policy, list[str]]:
    """The policy to check (the file, else the one the connector config names) and the
    connector's problems, one line each."""
    if transfer is None:
        return load_policy(file), []
    from kvtier.connector.config import parse_extra_config
    kv = _transfer_json(transfer)
    notes = []
    if kv.get("kv_connector") != "KVTierConnector":
        notes.append(f"--kv-transfer-config: kv_connector is {kv.get('kv_connector')!r}; "
                     "set it to \"KVTierConnector\"")
    if kv.get("kv_connector_module_path") != "kvtier.connector":
        notes.append("--kv-transfer-config: kv_connector_module_path is "
                     f"{kv.get('kv_connector_module_path')!r}; set it to \"kvtier.connector\"")
    extra = kv.get("kv_connector_extra_config") or {}
    if file is not None:  # the file given wins over the one the connector config names
        extra = {k: v for k, v in extra.items() if k not in ("kvtier_config", "policy")}
        extra["kvtier_config"] = str(file)
    policy = parse_extra_config(extra).policy
    if policy.chunk_tokens % block_size:
        notes.append(f"chunk_tokens: {policy.chunk_tokens} is not a multiple of vLLM's block "
                     f"size {block_size}; set chunk_tokens to a multiple of it (e.g. "
                     f"{math.lcm(policy.chunk_tokens, block_size)}) or pass the --block-size "
                     "vLLM runs with")
    return policy, notes


def _transfer_json(text: str) -> dict:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as e:
            raise ConfigError(f"--kv-transfer-config: cannot read {text[1:]} ({e.strerror})"
                              ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--kv-transfer-config: not valid JSON at line {e.lineno}, column "
                          f"{e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError("--kv-transfer-config: expected a JSON object like vLLM's "
                          "--kv-transfer-config")
    return data
