"""The embedded master: start, answer, stop; join-or-own; clear errors when it cannot run."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from kvtier.store.base.config import MasterConfig
from kvtier.store.base.errors import MasterError
from kvtier.tiers.mooncake import master as master_mod
from kvtier.tiers.mooncake.master import (EmbeddedMaster, check_shared_libraries, ensure_master,
                                 find_master_binary, free_port, master_answers)


def test_start_answer_stop(tmp_path):
    cfg = MasterConfig(address=f"127.0.0.1:{free_port()}")
    with EmbeddedMaster(cfg, log_path=tmp_path / "m.log") as m:
        assert m.alive() and master_answers(m.address)
        assert m.host == "127.0.0.1"
        cmd = " ".join(m.command())
        assert "-rpc_address=127.0.0.1" in cmd and "-metrics_host=127.0.0.1" in cmd
        out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
        mine = [ln for ln in out.splitlines() if f"pid={m.proc.pid}," in ln]
        assert mine and all("127.0.0.1:" in ln for ln in mine), mine  # loopback only
    assert not master_answers(cfg.address)


def test_port_in_use_is_a_clear_error(mooncake_master, tmp_path):
    cfg = MasterConfig(address=mooncake_master.address)
    with pytest.raises(MasterError, match="already in use"):
        EmbeddedMaster(cfg).start()


def taken_admin_port(monkeypatch, times: int):
    """A real listener on a loopback port that the next `times` admin-port picks return."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    real, picks = master_mod.free_port, []

    def pick(host="127.0.0.1"):
        picks.append(host)
        # With port 0 in the address the RPC port is picked first, then the admin port.
        admin_pick = len(picks) % 2 == 0
        return port if admin_pick and len(picks) <= 2 * times else real(host)

    monkeypatch.setattr(master_mod, "free_port", pick)
    return listener, port


def test_a_port_taken_between_pick_and_bind_is_picked_again(tmp_path, monkeypatch):
    listener, taken = taken_admin_port(monkeypatch, times=1)
    with listener, EmbeddedMaster(MasterConfig(address="127.0.0.1:0"),
                                  log_path=tmp_path / "m.log") as m:
        assert m.alive() and master_answers(m.address)
        assert m.metrics_port != taken and m.health()["status"] == "ok"
        assert m.cfg.address == m.address and m.rpc_port != 0  # a restart finds it again
        assert f"127.0.0.1:{taken}: Address already in use" in (tmp_path / "m.log").read_text()


def test_a_port_taken_at_every_pick_is_a_clear_error(tmp_path, monkeypatch):
    listener, taken = taken_admin_port(monkeypatch, times=master_mod.PORT_ATTEMPTS)
    with listener, pytest.raises(MasterError, match="exited with code 1 at start"):
        EmbeddedMaster(MasterConfig(address="127.0.0.1:0"), log_path=tmp_path / "m.log").start()
    log = (tmp_path / "m.log").read_text()
    assert log.count(f"{taken}: Address already in use") == master_mod.PORT_ATTEMPTS


def test_missing_binary_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setattr(master_mod.sys, "prefix", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(MasterError, match=r"mooncake_master not found; install it: pip install"):
        find_master_binary()


def test_missing_shared_library_names_the_debian_packages(tmp_path):
    (tmp_path / "lib.c").write_text("int kvtier_probe(void) { return 7; }\n")
    (tmp_path / "main.c").write_text("int kvtier_probe(void);\nint main(void) "
                                     "{ return kvtier_probe(); }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", tmp_path / "libkvprobe.so",
                    tmp_path / "lib.c"], check=True)
    subprocess.run(["gcc", "-o", tmp_path / "fake_master", tmp_path / "main.c",
                    f"-L{tmp_path}", "-lkvprobe"], check=True)
    (tmp_path / "libkvprobe.so").unlink()
    with pytest.raises(MasterError, match="cannot load libkvprobe.so; install the Debian "
                                          "packages: apt-get install libibverbs1"):
        check_shared_libraries(tmp_path / "fake_master")


def test_master_that_dies_at_start_reports_its_error(tmp_path):
    cfg = MasterConfig(address=f"127.0.0.1:{free_port()}",
                       extra_flags={"memory_allocator": "no-such-allocator"})
    with pytest.raises(MasterError, match="exited with code"):
        EmbeddedMaster(cfg, log_path=tmp_path / "m.log").start()


def test_ensure_master_joins_one_that_answers(mooncake_master):
    assert ensure_master(MasterConfig(address=mooncake_master.address)) is None


def test_not_embedded_and_nothing_answers():
    cfg = MasterConfig(address=f"127.0.0.1:{free_port()}", embedded=False)
    with pytest.raises(MasterError, match="no Mooncake master answers"):
        ensure_master(cfg)


ENGINE = textwrap.dedent("""
    import sys, time
    from kvtier.store.base.config import MasterConfig
    from kvtier.tiers.mooncake.master import ensure_master
    owned = ensure_master(MasterConfig(address=sys.argv[1]))
    print("owner" if owned else "joined", owned.proc.pid if owned else 0, flush=True)
    time.sleep(float(sys.argv[2]))
""")


def test_two_engines_one_after_the_other_share_one_master(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    first = subprocess.Popen([sys.executable, "-c", ENGINE, address, "30"],
                             stdout=subprocess.PIPE, text=True)
    try:
        role, pid = first.stdout.readline().split()
        assert role == "owner"
        second = subprocess.run([sys.executable, "-c", ENGINE, address, "0"],
                                capture_output=True, text=True, timeout=60)
        assert second.stdout.split()[0] == "joined"
    finally:
        first.terminate()
        first.wait(30)
    deadline = time.monotonic() + 10  # the owner stops its master on a clean exit
    while master_answers(address) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not master_answers(address)


def test_two_engines_at_once_end_up_on_one_master(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", ENGINE, address, "3"],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    roles = sorted(p.stdout.readline().split()[0] for p in procs)
    for p in procs:
        p.wait(60)
    assert roles == ["joined", "owner"]
