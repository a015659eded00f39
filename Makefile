# ftc10d developer entry points. `make demo` and `make test` are all a newcomer needs.
#
# The virtualenvs are built once and then reused: a stamp file inside each one
# records a finished install, and is redone only when pyproject.toml changes.
# torch is pinned to an exact version: a bare `pip install torch` would pull a
# multi-GB CUDA build, while torch==2.13.0 resolves to the CPU wheel this
# machine image provides (pip's find-links), which is all the Gloo tests need.

PYTHON          ?= python3
TORCH_VERSION   ?= 2.13.0
TORCH214_VERSION ?= 2.14.1
TORCH211_VERSION ?= 2.11.0
TORCH212_VERSION ?= 2.12.0
TORCH215_VERSION ?= 2.15.0
VENV            ?= .venv
VENV214         ?= .venv214
VENV211         ?= .venv211
VENV212         ?= .venv212
VENV215         ?= .venv215
VENVTITAN       ?= .venvtitan
TRITON_VERSION  ?= 3.9.0
PIP_FLAGS       ?= --quiet
PYTEST_ARGS     ?=
TESTS           ?= tests

STAMP    := $(VENV)/.ftc10d-installed
STAMP214 := $(VENV214)/.ftc10d-installed
STAMP211 := $(VENV211)/.ftc10d-installed
STAMP212 := $(VENV212)/.ftc10d-installed
STAMP215 := $(VENV215)/.ftc10d-installed
STAMPTITAN := $(VENVTITAN)/.ftc10d-installed

.DEFAULT_GOAL := help
.PHONY: gpu-check test-channels test-torch-suite test-titan test-titan214 test-titan215 demo-titan bench-titan venvtitan help etcd venv venv214 venv211 venv212 venv215 test test-torch214 test-torch211 test-torch212 test-torch215 demo demo-hsdp bench clean distclean

help:  ## list the targets
	@echo "make demo            train on 4 workers while one is killed and one frozen; watch it recover in place"
	@echo "make demo-hsdp       the same as FT-HSDP (2 replicas x 2 FSDP2 shards): replicas and shards recover in place"
	@echo "make test            run the test suite (torch $(TORCH_VERSION) CPU, in $(VENV))"
	@echo "make test-channels   the Manager's tests with every group on two channels (CPU control, device data)"
	@echo "make test-torch214   run the test suite on torch $(TORCH214_VERSION) (in $(VENV214))"
	@echo "make test-torch211   ... on torch $(TORCH211_VERSION) (in $(VENV211); a CUDA build from the registry, GBs)"
	@echo "make test-torch212   ... on torch $(TORCH212_VERSION) (in $(VENV212); a CUDA build from the registry, GBs)"
	@echo "make test-torch215   ... on torch $(TORCH215_VERSION) (in $(VENV215); a CUDA build from the registry, GBs)"
	@echo "make demo-titan      torchtitan's llama3 on 2x2 FT-HSDP (CPU): a rank killed, then a replica (in $(VENVTITAN))"
	@echo "make test-titan      the torchtitan integration's tests (in $(VENVTITAN): torchtitan, triton)"
	@echo "make test-titan214   the same on torch $(TORCH214_VERSION) (torchtitan added to $(VENV214))"
	@echo "make test-titan215   the same on torch $(TORCH215_VERSION) (torchtitan added to $(VENV215))"
	@echo "make test-torch-suite torch's own distributed suite on Gloo and on ftc10d (torch $(TORCH215_VERSION)); fails on any test passing on Gloo only"
	@echo "make bench           run the scripts in benchmarks/ (bench-titan: torchtitan's, in $(VENVTITAN))"
	@echo "make gpu-check       NCCL adapter checks and benchmarks on this machine's GPU and torch (installs nothing)"
	@echo "make venv            only build $(VENV)"
	@echo "make clean           remove build outputs and caches (keeps the virtualenvs)"
	@echo "make distclean       clean, and remove the virtualenvs too"

venv: $(STAMP)
venv214: $(STAMP214)
venv211: $(STAMP211)
venv212: $(STAMP212)
venv215: $(STAMP215)
venvtitan: $(STAMPTITAN)

# One rule per virtualenv: create, pin torch first (so resolving '.[test]' can
# never swap it for another build), then install ftc10d editable with test extras.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)"
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) -e '.[test]'
	@touch $@

$(STAMP214): pyproject.toml
	$(PYTHON) -m venv $(VENV214)
	$(VENV214)/bin/python -m pip install $(PIP_FLAGS) "torch==$(TORCH214_VERSION)"
	$(VENV214)/bin/python -m pip install $(PIP_FLAGS) -e '.[test]'
	@touch $@

# torch 2.11, 2.12 and 2.15 come from the registry; this machine image caps pip at 2.14.1 with a
# constraints file, which these installs replace by one that pins their own torch (so that
# resolving '.[test]' can never swap it either).
# $(1): the virtualenv, $(2): its torch version.
define pinned_venv
$(1)/.ftc10d-installed: pyproject.toml
	$(PYTHON) -m venv $(1)
	echo "torch==$(2)" > $(1)/torch-pin.txt
	PIP_CONSTRAINT=$(1)/torch-pin.txt $(1)/bin/python -m pip install $(PIP_FLAGS) "torch==$(2)"
	PIP_CONSTRAINT=$(1)/torch-pin.txt $(1)/bin/python -m pip install $(PIP_FLAGS) -e '.[test]'
	@touch $$@
endef
$(eval $(call pinned_venv,$(VENV211),$(TORCH211_VERSION)))
$(eval $(call pinned_venv,$(VENV212),$(TORCH212_VERSION)))
$(eval $(call pinned_venv,$(VENV215),$(TORCH215_VERSION)))

# torchtitan (ftc10d.integrations.torchtitan) in its own virtualenv: torch $(TORCH_VERSION) CPU, torchtitan and
# triton (which torchtitan imports unconditionally; ~300 MB from the registry), pinned by a constraints file.
$(STAMPTITAN): pyproject.toml
	$(PYTHON) -m venv $(VENVTITAN)
	printf 'torch==$(TORCH_VERSION)\ntriton==$(TRITON_VERSION)\n' > $(VENVTITAN)/pins.txt
	PIP_CONSTRAINT=$(VENVTITAN)/pins.txt $(VENVTITAN)/bin/python -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)"
	PIP_CONSTRAINT=$(VENVTITAN)/pins.txt $(VENVTITAN)/bin/python -m pip install $(PIP_FLAGS) -e '.[test,torchtitan]'
	@touch $@

# etcd (the HA membership backend's server) comes from Debian; installed only when missing
# and only as root. Without it the etcd tests skip, saying why, or fail under
# FTC10D_REQUIRE_ETCD=1 (which .ci/run sets). Debian's package starts a system etcd on 2379;
# the tests start their own on other ports, so the one installed here is disabled at once
# (an etcd that was already there is left as it is).
etcd:
	@command -v etcd >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null && \
	    { systemctl disable --now etcd >/dev/null 2>&1 || true; }; \
	  fi; \
	  command -v etcd >/dev/null 2>&1 || \
	    echo "make: etcd is not installed (that needs root, apt-get and the Debian archive): the etcd tests will skip"; }

test: $(STAMP) etcd
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) $(TESTS)

test-torch214: $(STAMP214) etcd
	$(VENV214)/bin/python -m pytest -q $(PYTEST_ARGS) $(TESTS)

test-torch211: $(STAMP211) etcd
	$(VENV211)/bin/python -m pytest -q $(PYTEST_ARGS) $(TESTS)

test-torch212: $(STAMP212) etcd
	$(VENV212)/bin/python -m pytest -q $(PYTEST_ARGS) $(TESTS)

test-torch215: $(STAMP215) etcd
	$(VENV215)/bin/python -m pytest -q $(PYTEST_ARGS) $(TESTS)

# torch's own distributed test suite (DistributedTest._DistTestBase, in the wheel), on Gloo and on
# ftc10d, the same selection, both held to Gloo's expectations (tests/torch_suite); in CI (~5.5 min
# at world sizes 2 and 3 on 2 cores). SUITE_ARGS="-k EXPR" picks tests.
SUITE_ARGS ?=
test-torch-suite: $(STAMP215)
	PIP_CONSTRAINT=$(VENV215)/torch-pin.txt $(VENV215)/bin/python -m pip install $(PIP_FLAGS) expecttest
	$(VENV215)/bin/python -m tests.torch_suite.compare --world-sizes 2,3 $(SUITE_ARGS)

test-titan: $(STAMPTITAN)
	$(VENVTITAN)/bin/python -m pytest -q $(PYTEST_ARGS) tests/integrations

# The same tests on torch $(TORCH214_VERSION) and $(TORCH215_VERSION) (CUDA builds, running on CPU): torchtitan added to
# their virtualenvs, torch held at its pin (their triton is a dependency of those builds already).
test-titan214: $(STAMP214)
	$(VENV214)/bin/python -m pip install $(PIP_FLAGS) -e '.[test,torchtitan]'
	$(VENV214)/bin/python -m pytest -q $(PYTEST_ARGS) tests/integrations

test-titan215: $(STAMP215)
	PIP_CONSTRAINT=$(VENV215)/torch-pin.txt $(VENV215)/bin/python -m pip install $(PIP_FLAGS) -e '.[test,torchtitan]'
	$(VENV215)/bin/python -m pytest -q $(PYTEST_ARGS) tests/integrations

# The Manager's and the chaos runner's tests (DDP, FT-HSDP, recovery, second history, node loss...) with every job's groups on two
# channels (ftc10d.pg.channels): the CPU one for the control path, the device one (Gloo with NCCL's
# semantics, as NCCL cannot run here) for the data.
CHANNELS_SPEC ?= cpu:gloo,cuda:gloo-as-nccl
test-channels: $(STAMP) etcd
	FTC10D_BACKEND=$(CHANNELS_SPEC) $(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) tests/train tests/pg/test_channels.py \
	  tests/chaos/test_chaos.py

demo-titan: $(STAMPTITAN)
	$(VENVTITAN)/bin/python -m ftc10d.integrations.torchtitan.demo

demo: $(STAMP)
	$(VENV)/bin/ftc10d demo

demo-hsdp: $(STAMP)
	$(VENV)/bin/ftc10d demo --mesh 2x2

# Every benchmarks/*.py that is not a helper module (leading underscore), from the
# repository root so that `tests.harness` and `benchmarks` import as packages.
bench: $(STAMP)
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) -e '.[test,bench]'
	@set -e; found=0; \
	for f in benchmarks/*.py; do \
	  case "$$(basename "$$f")" in _*|'*.py'|titan_*) continue;; esac; \
	  found=1; echo "== $$f"; PYTHONPATH=. $(VENV)/bin/python "$$f"; \
	done; \
	if [ $$found = 0 ]; then echo "no benchmarks in benchmarks/ yet"; fi

# torchtitan's benchmarks run in its virtualenv (make venvtitan).
bench-titan: $(STAMPTITAN)
	PYTHONPATH=. $(VENVTITAN)/bin/python benchmarks/titan_step.py
	PYTHONPATH=. $(VENVTITAN)/bin/python benchmarks/titan_step.py --recovery

clean:
	rm -rf build dist src/*.egg-info .pytest_cache demo-out bench-out
	find . -path ./$(VENV) -prune -o -path ./$(VENV214) -prune -o -path ./$(VENV211) -prune -o -path ./$(VENV215) \
	  -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VENV214) $(VENV211) $(VENV212) $(VENV215) $(VENVTITAN)

# The GPU machines lent to this project carry their own torch (2.11, CUDA, NCCL) and reach no
# package registry: run with the python that has it, install nothing. Skips without CUDA.
GPU_PYTHON ?= python3
gpu-check:  ## NCCL adapter checks and benchmarks on one GPU (issue 17)
	PYTHONPATH=src:. timeout 360 $(GPU_PYTHON) benchmarks/gpu_check.py
