"""Bad input fails at start, in one line that names the field and says what to do.

The corpus (`corpus/`) holds malformed tier policies (`policy_*.yaml`) and connector configs
(`connector_*.yaml`, the `kv_connector_extra_config` mapping). The first comment lines say
what must happen:
- `# expect: REGEX`: loading fails with a ConfigError matching REGEX;
- `# start: REGEX`: the policy is valid, opening the store fails with a KVTierError;
- `# block_size: N`: the connector config is parsed, then keyed for a vLLM block size N
  (what the scheduler side does at start), which must fail.
Paths in the corpus use `$KVTIER_FAULT_ROOT`, set to the test's temp dir.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from kvtier.connector.config import parse_extra_config
from kvtier.store.base.config import load_policy
from kvtier.store.base.errors import ConfigError, KVTierError
from kvtier.store.tiered import TieredStore

CORPUS = Path(__file__).with_name("corpus")
CASES = sorted(p.name for p in CORPUS.glob("*.yaml"))
# Every message tells the operator what to do, not only what is wrong.
FIX_WORDS = re.compile(r"expected|should|must|required|set |use |check|give|point|mount|"
                       r"raise|omit|create|remove|fix|install|restore|start")


def header(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"#\s*(expect|start|block_size):\s?(.*)$", line)
        if not m:
            break
        out[m.group(1)] = m.group(2)
    return out


def first_error(path: Path) -> KVTierError:
    spec = header(path.read_text())
    if path.name.startswith("policy_"):
        if "expect" in spec:
            with pytest.raises(ConfigError) as err:
                load_policy(path)
            return err.value
        policy = load_policy(path)
        with pytest.raises(KVTierError) as err:
            TieredStore(policy, start_master=False, mover=False).close()
        return err.value
    extra = yaml.safe_load(path.read_text())
    with pytest.raises(ConfigError) as err:
        cfg = parse_extra_config(extra)
        start_connector(cfg.policy, int(spec["block_size"]))
    return err.value


def start_connector(policy, block_size: int) -> None:
    """Key a request's blocks for the tiny model at `block_size`, as the scheduler does."""
    from kvtier.connector.naming import KVShape, make_namespace
    vllm = SimpleNamespace(model_config=SimpleNamespace(model="tiny"),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                           pipeline_parallel_size=1))
    make_namespace(vllm, KVShape(2, 2, block_size, 256, "bfloat16"), policy)


def test_the_corpus_is_big_enough():
    assert sum(c.startswith("policy_") for c in CASES) >= 25
    assert sum(c.startswith("connector_") for c in CASES) >= 15


@pytest.mark.parametrize("case", CASES)
def test_bad_input_fails_at_start_in_one_line(case, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_FAULT_ROOT", str(tmp_path))
    (tmp_path / "a-file").write_text("not a directory\n")
    monkeypatch.chdir(CORPUS)  # relative kvtier_config paths resolve inside the corpus
    spec = header((CORPUS / case).read_text())
    pattern = spec.get("expect") or spec["start"]
    err = first_error(CORPUS / case)
    msg = str(err)
    assert "\n" not in msg, msg
    assert re.search(pattern, msg), f"{case}: {msg!r} does not match {pattern!r}"
    assert FIX_WORDS.search(msg), f"{case}: {msg!r} names no fix"
    assert "Traceback" not in msg and len(msg) < 400, msg
