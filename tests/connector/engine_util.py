"""Engine harness for the connector tests: the tiny model, engine processes, one kvtier cluster.

- `Cluster`: a real `mooncake_master` on loopback (restartable on the same port, killable),
  one shared directory (the sharedfs tier every instance sees) and one directory per node
  (its index and nvme tier); `policy(node)` is that node's inline policy.
- `Engines`: engine processes started on first use and kept for the whole test module
  (startup is the slow part on two cores), a few at a time, each with a KV cache sized to
  the tiny model; closed at the end.
- `chunk_keys(prompt)`: the kvtier keys of a prompt's chunks, computed as the connector does.

Engines compute in float32: greedy tokens of a random model flip on bf16 rounding when only
the batch shape changes (vLLM alone shows it), which would hide what the tests look for.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvtier.store.base.config import MasterConfig
from kvtier.tiers.mooncake.master import EmbeddedMaster, free_port
from kvtier.tools.threads import in_threads
from kvtier.tools.vllm_engine import (BLOCK_SIZE, MAX_MODEL_LEN, Engine, Output,
                                      kvtier_transfer_config, make_tiny_model, prompt_keys,
                                      random_prompt)

BLOCK = 32
CHUNK = 64
DTYPE = "float32"
MODEL_NAME = "tiny-llama"
MAX_ALIVE = 4  # engines a module keeps started at once

__all__ = ["BLOCK", "BLOCK_SIZE", "CHUNK", "Cluster", "Engines", "Output", "chunk_keys",
           "make_tiny_model", "random_prompt", "full_block_tokens", "kvtier_transfer_config", "save_tokenizer"]


def save_tokenizer(path, special: list[str]) -> dict[str, int]:
    """A word-level tokenizer with `special` as added tokens, saved under `path` (beside the
    tiny model, for what reads the model's tokenizer); returns its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"w{i}": i for i in range(300)} | {"[UNK]": 300}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="w0")
    fast.add_special_tokens({"additional_special_tokens": special})
    fast.save_pretrained(path)
    return fast.get_vocab()



def full_block_tokens(prompt: list[int]) -> int:
    return len(prompt) // BLOCK * BLOCK


class Cluster:
    """A kvtier cluster on one machine: a master, a shared dir, a dir per node."""

    def __init__(self, root: Path):
        self.root = root
        self.shared = root / "shared"
        self.master_cfg = MasterConfig(address=f"127.0.0.1:{free_port()}")
        self._restarts = 0
        self.master: EmbeddedMaster | None = None
        self.start_master()

    @property
    def address(self) -> str:
        return self.master_cfg.address

    def start_master(self) -> None:
        log = self.root / f"master-{self._restarts}.log"
        self._restarts += 1
        self.master = EmbeddedMaster(self.master_cfg, log_path=log).start()

    def kill_master(self) -> None:
        self.master.kill()

    def restart_master(self) -> None:
        """Stop and start on the same port: every object of the DRAM pool is gone."""
        self.master.stop()
        self.start_master()

    def policy(self, node: str, tiers: tuple[str, ...] = ("dram", "nvme", "shared"),
               **over) -> dict:
        node_dir = self.root / node
        all_tiers = {
            "dram": {"name": "dram", "kind": "mooncake", "capacity": "128MiB",
                     "buffer": "32MiB", "staging": "32MiB"},
            "nvme": {"name": "nvme", "kind": "nvme", "path": str(node_dir / "nvme"),
                     "capacity": "256MiB", "region_size": "4MiB"},
            "shared": {"name": "shared", "kind": "sharedfs", "path": str(self.shared),
                       "capacity": "512MiB"},
        }
        data = {"namespace": {"model": MODEL_NAME}, "chunk_tokens": CHUNK,
                "index": {"path": str(node_dir / "index"), "map_size": "64MiB"},
                "master": {"address": self.address, "embedded": False},
                "admission": {"kind": "always"},
                "tiers": [all_tiers[t] for t in tiers]}
        data.update(over)
        return data

    def transfer_config(self, node: str, load_deadline: bool = False, **policy_over) -> dict:
        """The engine's kv-transfer-config. Loads without deadlines unless asked: a tiny
        model on a busy CI host recomputes a hit about as fast as it loads it, and the tests
        that assert where each token came from would then measure the plan, which
        `test_deadline` and `test_recompute` check on their own."""
        return kvtier_transfer_config(self.policy(node, **policy_over), node_id=node,
                                      load_deadline=load_deadline)

    def probe(self, tiers: tuple[str, ...] = ("dram", "nvme", "shared")):
        """A store over the cluster's `tiers` that lends nothing and runs no mover: to ask
        what the engines' stores hold (a context manager)."""
        from kvtier.store.base.config import policy_from_dict
        from kvtier.store.tiered import TieredStore
        return TieredStore(policy_from_dict(self.policy("probe", tiers=tiers)),
                           node_id="probe", mover=False, lend=False, start_master=False)

    def close(self) -> None:
        if self.master is not None:
            self.master.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A module's kvtier cluster: one master, a shared dir, per-node indexes and nvme dirs
    (a module takes it with `from engine_util import cluster`)."""
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.close()


def kv_blocks_for(kw: dict) -> int:
    """The KV cache of a test engine, in blocks: eight prompts of the longest length the
    engine takes. The engine's default (a 1 GiB KV space) is that many times a tiny model's
    need and is touched at start: a module's dozen engines beside another module's would
    hold most of a 24 GiB CI host."""
    max_len = kw.get("max_model_len", MAX_MODEL_LEN)
    return 8 * -(-max_len // kw.get("block_size", BLOCK))


class Engines:
    """Named engine processes, started on first use, shared by a module's tests."""

    def __init__(self, model: Path, logs: Path, baseline_args: dict | None = None):
        self.model, self.logs = model, logs
        self.baseline_args = baseline_args  # what the kind needs to run without kvtier
        self._engines: dict[str, Engine] = {}
        self._baseline_outputs: dict[tuple, Output] = {}

    def get(self, name: str, kv_transfer_config: dict | None = None, **kw) -> Engine:
        """Engine `name`, started on first use. Past `MAX_ALIVE` engines the one used least
        recently is closed first (a test uses a few; a module's dozen at once, beside
        another module's, would crowd a 24 GiB CI host)."""
        if name not in self._engines:
            while len(self._engines) >= MAX_ALIVE:
                self.stop(next(iter(self._engines)))
            kw.setdefault("dtype", DTYPE)
            kw.setdefault("num_blocks", kv_blocks_for(kw))
            self._engines[name] = Engine(self.model, self.logs / f"{name}.log",
                                         kv_transfer_config=kv_transfer_config, **kw)
        self._engines[name] = self._engines.pop(name)  # the most recently used last
        return self._engines[name]

    def stop(self, name: str) -> None:
        """Close engine `name` (its connector finishes queued saves first)."""
        self._engines.pop(name).close()

    def baseline(self, prompt: list[int], max_tokens: int) -> Output:
        """The output of an engine without any connector (cached per prompt)."""
        key = (tuple(prompt), max_tokens)
        if key not in self._baseline_outputs:
            outs, _ = self.get("baseline", engine_args=self.baseline_args).generate(
                [prompt], max_tokens)
            self._baseline_outputs[key] = outs[0]
        return self._baseline_outputs[key]

    def baselines(self, prompts: list[list[int]], max_tokens: int) -> list[Output]:
        """Baseline outputs of several prompts in one batch (float32: batching does not
        change greedy tokens)."""
        todo = [p for p in prompts if (tuple(p), max_tokens) not in self._baseline_outputs]
        if todo:
            outs, _ = self.get("baseline", engine_args=self.baseline_args).generate(
                todo, max_tokens)
            for p, o in zip(todo, outs):
                self._baseline_outputs[(tuple(p), max_tokens)] = o
        return [self._baseline_outputs[(tuple(p), max_tokens)] for p in prompts]

    def close(self) -> None:
        """Stop every engine at once (each stops in its own process; one after the other,
        the engines of one module took over a minute to stop)."""
        in_threads([engine.close for engine in self._engines.values()])
        self._engines.clear()


def tiny_engines(tmp_path_factory, name: str = "tiny-llama", kind: str = "llama",
                 baseline_args: dict | None = None) -> Engines:
    """A module's engine pool over a tiny random model of `kind` made in the test."""
    model = make_tiny_model(tmp_path_factory.mktemp("model") / name, kind)
    return Engines(model, tmp_path_factory.mktemp("engine-logs"), baseline_args)


def chunk_keys(prompt: list[int], policy: dict, kind: str = "llama") -> list[str]:
    """The rank-0 keys of `prompt`'s full chunks under `policy`, as the connector names them
    for the tiny model of `kind`."""
    return prompt_keys(prompt, policy, DTYPE, BLOCK_SIZE[kind], kind)


def files_of(root: Path, keys: list[str]) -> list[Path]:
    """The files under `root` whose names contain one of `keys` (sharedfs stores a file per
    block, named by its key)."""
    wanted = {k: None for k in keys}
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # not .quarantine, not temps
        for name in names:
            for key in wanted:
                if key in name and not name.endswith(".tmp"):
                    wanted[key] = Path(dirpath) / name
    return [wanted[k] for k in keys if wanted[k] is not None]


def in_pool(cluster: Cluster, prompt: list[int]) -> bool:
    """Whether every full chunk of `prompt` is in the pool (a lender saves after it answers)."""
    keys = chunk_keys(prompt, cluster.policy("probe", tiers=("dram",)))
    with cluster.probe(("dram",)) as store:
        return store.lookup(keys, observe=False).hit_blocks == len(keys)


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def cache_config(spec, layers=2):
    """A `KVCacheConfig` of one group of `spec` over `layers` layers and 8 blocks."""
    from vllm.v1 import kv_cache_interface as vllm_kv

    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    tensor = vllm_kv.KVCacheTensor(size=layers * 8 * spec.page_size_bytes, layers=names,
                                   layer_stride=8 * spec.page_size_bytes,
                                   block_stride=spec.page_size_bytes)
    return vllm_kv.KVCacheConfig(num_blocks=8, kv_cache_tensors=[tensor],
                                 kv_cache_groups=[vllm_kv.KVCacheGroupSpec(names, spec)])
