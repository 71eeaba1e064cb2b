"""The policy schema: good files resolve, every bad file fails with one line naming the field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from kvtier.store.base.config import load_policy, policy_from_dict
from kvtier.store.base.errors import ConfigError


def base(tmp_path):
    return {
        "namespace": {"model": "tiny-llama"},
        "chunk_tokens": 256,
        "index": {"path": str(tmp_path / "index"), "map_size": "8MiB"},
        "master": {"address": "127.0.0.1:50051", "embedded": True},
        "tiers": [
            {"name": "dram", "kind": "mooncake", "capacity": "512MiB", "protocol": "tcp"},
            {"name": "nvme", "kind": "nvme", "path": str(tmp_path / "nvme"), "capacity": "4TiB",
             "io": {"engine": "uring", "queue_depth": 64}},
            {"name": "shared", "kind": "sharedfs", "path": str(tmp_path / "shared"),
             "capacity": "50TiB"},
        ],
        "eviction": {"kind": "lru"},
        "admission": {"nvme_write_budget": "2TiB/day"},
    }


def write(tmp_path, data, name="policy.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_design_sketch_policy_resolves(tmp_path):
    policy = load_policy(write(tmp_path, base(tmp_path)))
    assert policy.tiers[0].capacity_bytes == 512 * 2**20
    assert policy.tiers[1].capacity_bytes == 4 * 2**40
    assert policy.tiers[1].io.queue_depth == 64
    assert policy.admission.kind == "reuse"
    assert policy.admission.nvme_write_budget_bps == pytest.approx(2 * 2**40 / 86400)
    assert policy.index.map_size_bytes == 8 * 2**20
    with pytest.raises(Exception):
        policy.chunk_tokens = 1  # frozen


def test_default_policy_needs_no_file(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))
    policy = load_policy(None)
    assert policy.master.address == "127.0.0.1:50051" and policy.master.embedded
    assert [t.kind for t in policy.tiers] == ["mooncake", "nvme", "sharedfs"]
    assert str(policy.tiers[1].path).startswith(str(tmp_path / "home"))
    assert str(policy.index.path).startswith(str(tmp_path / "home"))


def test_relative_paths_resolve_against_the_policy_file(tmp_path):
    data = base(tmp_path)
    data["tiers"][1]["path"] = "disk/nvme"
    policy = load_policy(write(tmp_path, data))
    assert policy.tiers[1].path == tmp_path / "disk" / "nvme"


def _set(data, path, value):
    cur = data
    for part in path[:-1]:
        cur = cur[part]
    if value is DELETE:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value


DELETE = object()

# (change, field path the message must name, a word the message must contain)
BAD = [
    (("bogus",), 1, "bogus", "unknown field"),
    (("tiers", 1, "colour"), "blue", "tiers[1].colour", "unknown field"),
    (("chunk_tokens",), "many", "chunk_tokens", "integer"),
    (("chunk_tokens",), 0, "chunk_tokens", "greater than"),
    (("tiers", 0, "capacity"), "-3GB", "tiers[0].capacity", "size"),
    (("tiers", 1, "capacity"), "lots", "tiers[1].capacity", "size"),
    (("tiers", 2, "capacity"), "12XB", "tiers[2].capacity", "size"),
    (("tiers", 1, "name"), "dram", "tiers[1].name", "duplicate"),
    (("tiers", 1, "kind"), "floppy", "tiers[1]", "unknown kind"),
    (("tiers", 1, "path"), DELETE, "tiers[1].path", "missing"),
    (("tiers", 2, "kind"), DELETE, "tiers[2]", "kind"),
    (("tiers", 0, "protocol"), "udp", "tiers[0].protocol", "tcp"),
    (("tiers", 1, "io", "engine"), "aio", "tiers[1].io.engine", "uring"),
    (("tiers", 1, "io", "queue_depth"), -1, "tiers[1].io.queue_depth", "greater"),
    (("eviction", "kind"), "random", "eviction", "unknown kind"),
    (("admission", "nvme_write_budget"), "2TiB", "admission.nvme_write_budget", "rate"),
    (("admission", "nvme_write_budget"), "2TiB/fortnight", "admission.nvme_write_budget", "rate"),
    (("master", "address"), "localhost", "master.address", "HOST:PORT"),
    (("master", "embedded"), "perhaps", "master.embedded", "boolean"),
    (("master", "etcd"), ["10.0.0.1"], "master.etcd[0]", "HOST:PORT"),
    (("master", "etcd"), ["10.0.0.1:2379", "10.0.0.1:2379"], "master.etcd", "twice"),
    (("index", "map_size"), "0", "index.map_size", "greater"),
    (("index",), DELETE, None, None),  # the index path defaults: this one must pass
    (("namespace", "tenant"), "a/b", "namespace.tenant", "letters"),
    (("tiers",), [], "tiers", "at least 1"),
    (("tiers", 1, "region_size"), "1000", "tiers[1]", "4KiB"),
]


@pytest.mark.parametrize("path,value,field,word", BAD, ids=[".".join(map(str, b[0])) + "=" +
                                                           str(b[1])[:12] for b in BAD])
def test_bad_policy_names_the_field(tmp_path, path, value, field, word):
    data = base(tmp_path)
    _set(data, path, value)
    file = write(tmp_path, data)
    if field is None:
        load_policy(file)
        return
    with pytest.raises(ConfigError) as info:
        load_policy(file)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(str(file) + ": ")
    assert f": {field}" in msg, msg
    assert word.lower() in msg.lower(), msg


def test_tiers_out_of_order(tmp_path):
    data = base(tmp_path)
    data["tiers"] = [data["tiers"][1], data["tiers"][0], data["tiers"][2]]
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.kind: tiers must go fastest first"):
        load_policy(write(tmp_path, data))


def test_two_tiers_on_one_path(tmp_path):
    data = base(tmp_path)
    data["tiers"][2]["path"] = data["tiers"][1]["path"]
    with pytest.raises(ConfigError, match=r"tiers\[2\]\.path: same path as tier 'nvme'"):
        load_policy(write(tmp_path, data))


@pytest.mark.parametrize("text,word", [
    ("tiers: [unclosed", "not valid YAML at line"),
    ("- just\n- a list\n", "expected a mapping"),
    ("chunk_tokens: 1\n\tbad: tab", "not valid YAML"),
])
def test_unparsable_files(tmp_path, text, word):
    with pytest.raises(ConfigError, match=word):
        load_policy(write(tmp_path, text))


def test_missing_file_names_path_and_fix(tmp_path):
    with pytest.raises(ConfigError, match="no such policy file"):
        load_policy(tmp_path / "nope.yaml")


def test_inline_policy_reports_its_source():
    with pytest.raises(ConfigError, match=r"^<inline policy>: tiers: required field"):
        policy_from_dict({"chunk_tokens": 16})


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvtier.tools.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_config_check(tmp_path):
    good = write(tmp_path, base(tmp_path))
    out = _cli("config", "check", str(good), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["tiers"][1]["capacity"] == 4 * 2**40  # the file's key, in bytes for scripts
    assert out.stderr.splitlines()[-1] == f"ok {good}"  # after the free-space warnings
    bad = base(tmp_path)
    bad["tiers"][0]["capacity"] = "huge"
    out = _cli("config", "check", str(write(tmp_path, bad, "bad.yaml")))
    assert out.returncode == 3  # invalid; 2 is left to usage mistakes
    assert "tiers[0].capacity" in out.stderr and out.stderr.count("\n") == 1
    assert _cli("config", "check", "--no-such-flag").returncode == 2


def test_show_prints_the_policy_as_its_file_writes_it_and_it_loads_back(tmp_path):
    data = base(tmp_path)
    data["eviction"] = {"kind": "agentic", "idle_demote_after": "p90_gap"}
    data["tiers"][2]["file_mode"] = 0o640
    data["tiers"][1]["path"] = "disk/nvme"  # relative: printed absolute
    src = write(tmp_path, data)
    out = _cli("config", "show", str(src))
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)  # stdout is the YAML alone
    assert shown["tiers"][1]["capacity"] == "4TiB" and "capacity_bytes" not in out.stdout
    assert shown["index"]["map_size"] == "8MiB"
    assert shown["eviction"]["idle_demote_after"] == "p90_gap"
    assert shown["tiers"][2]["file_mode"] == "0o640"
    assert shown["admission"]["nvme_write_budget"] == "2TiB/day"
    assert shown["tiers"][1]["path"] == str(tmp_path / "disk" / "nvme")
    again = load_policy(write(tmp_path, out.stdout, "again.yaml"))
    assert again.to_dict() == load_policy(src).to_dict()


def test_every_mistake_of_a_policy_is_listed(tmp_path):
    data = base(tmp_path)
    data["tiers"][0]["capacity"] = "huge"
    data["chunk_tokens"] = "many"
    with pytest.raises(ConfigError) as err:
        load_policy(write(tmp_path, data))
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and any("tiers[0].capacity" in x for x in lines) and \
        any("chunk_tokens" in x for x in lines)


def test_an_index_section_with_sizes_only_keeps_the_default_path(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))
    data = base(tmp_path)
    data["index"] = {"map_size": "64MiB"}
    policy = load_policy(write(tmp_path, data))
    assert policy.index.path == tmp_path / "home" / "index"
    assert policy.index.map_size_bytes == 64 << 20


@pytest.mark.parametrize("field", ["index", "nvme", "shared", "segment_dir"])
def test_check_refuses_a_path_that_is_a_file(tmp_path, field):
    data = base(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    where = {"index": ("index", "path"), "nvme": ("tiers", 1, "path"),
             "shared": ("tiers", 2, "path"), "segment_dir": ("tiers", 0, "segment_dir")}[field]
    _set(data, where, str(afile))
    out = _cli("config", "check", str(write(tmp_path, data)))
    assert out.returncode == 3
    named = {"index": "index.path", "nvme": "tiers[1].path", "shared": "tiers[2].path",
             "segment_dir": "tiers[0].segment_dir"}[field]
    assert f"{named}: {afile} is a file, not a directory" in out.stderr


def test_check_refuses_a_missing_parent_and_warns_of_small_disks(tmp_path):
    data = base(tmp_path)
    data["tiers"][1]["path"] = str(tmp_path / "not-mounted" / "nvme")
    out = _cli("config", "check", str(write(tmp_path, data)))
    assert out.returncode == 3 and "neither does its parent" in out.stderr
    data = base(tmp_path)  # 50TiB of shared and 4TiB of nvme on a test machine's disk
    out = _cli("config", "check", str(write(tmp_path, data)))
    assert out.returncode == 0 and "warning: tiers[2].path" in out.stderr


def transfer(**extra) -> str:
    return json.dumps({"kv_connector": "KVTierConnector",
                       "kv_connector_module_path": "kvtier.connector", "kv_role": "kv_both",
                       "kv_connector_extra_config": extra})


@pytest.mark.parametrize("extra,block,word", [
    ({"colour": "blue"}, 16, "kv_connector_extra_config: colour: unknown field"),
    ({"kvtier_config": "/no/such/policy.yaml"}, 16, "no such policy file"),
    ({"policy": {"chunk_tokens": 100, "tiers": [
        {"name": "dram", "kind": "mooncake", "capacity": "1GiB"}]}}, 16,
     "chunk_tokens: 100 is not a multiple of vLLM's block size 16"),
])
def test_check_takes_the_vllm_side_and_never_loads_vllm(tmp_path, extra, block, word):
    code = ("import sys\nfrom kvtier.tools.cli import main\n"
            f"sys.argv = ['kvtier', 'config', 'check', '--kv-transfer-config', {transfer(**extra)!r},"
            f" '--block-size', '{block}']\n"
            "try:\n    main()\nexcept SystemExit as e:\n"
            "    assert 'vllm' not in sys.modules and 'torch' not in sys.modules\n"
            "    raise\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**__import__('os').environ,
                                          "KVTIER_HOME": str(tmp_path)})
    assert out.returncode == 3, out.stderr
    assert word in out.stderr and "Traceback" not in out.stderr


def test_check_of_a_good_vllm_side_passes(tmp_path):
    pol = write(tmp_path, base(tmp_path) | {"chunk_tokens": 256})
    out = _cli("config", "check", "--kv-transfer-config", transfer(kvtier_config=str(pol)),
               "--block-size", "32")
    assert out.returncode == 0, out.stderr
    bad = json.dumps({"kv_connector": "KVTier", "kv_connector_module_path": "kvtier"})
    out = _cli("config", "check", str(pol), "--kv-transfer-config", bad)
    assert out.returncode == 3 and 'set it to "KVTierConnector"' in out.stderr


def test_kvtier_must_demote_before_the_master_evicts(tmp_path):
    data = base(tmp_path)
    data["mover"] = {"high_watermark": 0.97}
    with pytest.raises(ConfigError, match=r"mover.high_watermark: must be below "
                                          r"master.eviction_high_watermark_ratio"):
        load_policy(write(tmp_path, data))


def test_segment_dir_and_service_exclude_each_other(tmp_path):
    data = base(tmp_path)
    data["tiers"][0].update(service="127.0.0.1:5000", segment_dir=str(tmp_path / "shm"))
    with pytest.raises(ConfigError, match="segment_dir and service exclude each other"):
        load_policy(write(tmp_path, data))


def test_ha_master_policy(tmp_path):
    """`master.etcd`: clients find the leader through etcd; HA masters are the operator's."""
    data = base(tmp_path)
    data["master"] = {"etcd": "10.0.0.1:2379, 10.0.0.2:2379", "address": "10.0.0.11:50051"}
    master = load_policy(write(tmp_path, data)).master
    assert master.ha and master.etcd == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert master.client_address == "etcd://10.0.0.1:2379;10.0.0.2:2379"
    assert not master.embedded  # the default, with etcd
    plain = load_policy(write(tmp_path, base(tmp_path), "plain.yaml")).master
    assert not plain.ha and plain.client_address == "127.0.0.1:50051"


def test_ha_master_cannot_be_embedded(tmp_path):
    data = base(tmp_path)
    data["master"] = {"etcd": ["10.0.0.1:2379"], "embedded": True}
    with pytest.raises(ConfigError, match=r"master\.embedded: HA masters \(master\.etcd\) are "
                                          r"run by the operator .*set master\.embedded: false"):
        load_policy(write(tmp_path, data))
