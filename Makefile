# The two commands README.md gives (run as root on a fresh machine):
#   sudo make demo   - set up, start a real tiny vLLM, attach, drive a workload, report
#   sudo make test   - set up, then run the tests (privileged ones included; not the matrix or the long ones)
VENV ?= .venv
PY := $(VENV)/bin/python
# The vLLM releases the hook is proven on, each with a live server (tests/vllm/test_compat.py,
# marked `matrix`): `make compat`, by hand; `make compat VLLM=0.25.0` tries another.  CI runs
# the default release (0.32.0, the whole suite) and checks the hook's plan on NEWEST's source.
COMPAT_RELEASES := 0.28.0 0.30.0 0.31.0 0.32.0
VLLM ?= $(COMPAT_RELEASES)
NEWEST := 0.33.0

.PHONY: setup setup-vllm setup-sglang setup-lmcache setup-nixl setup-router setup-engines demo test test-long unit compat lab bench bench-short bench-fleet engines clean

setup:
	bash scripts/setup-host

setup-vllm: setup
	bash scripts/setup-vllm

demo: setup-vllm
	$(VENV)/bin/kvtrace demo

# SGLang 0.5.23 on the CPU (tests/sglang): its own venv in /var/cache/kvtrace (about 5 minutes once)
setup-sglang: setup
	bash scripts/setup-sglang

# LMCache 0.5.6 multiprocess mode (tests/lmcache): a venv beside vLLM's that sees its packages (seconds)
setup-lmcache: setup-vllm
	bash scripts/setup-lmcache

# nixl 1.5.1 beside vLLM's venv, for the prefill/decode pair over NixlConnector (make test-long only)
setup-nixl: setup-vllm
	bash scripts/setup-nixl

# vllm-router 0.1.17 in its own venv, for the replicas behind a router (tests/fleet; seconds)
setup-router: setup
	bash scripts/setup-router

setup-engines: setup-vllm setup-sglang setup-lmcache setup-router
	bash scripts/setup-vllm-source $(NEWEST)

# Every test but the release matrix (`make compat`) and the long ones (`make test-long`): what CI runs
test: setup-engines
	$(PY) -m pytest -q -rs --durations=40 -m "not matrix and not long" tests

# By hand, before a release: the live tests at settings the rest does not use (closed loop under
# load, a throttled storage tier, a restarted server, a prefill/decode pair over NIXL) and
# Spark's report against DuckDB's
test-long: setup-engines setup-nixl
	$(PY) -m pytest -q -rs -m long tests

# Every release of VLLM through the live acceptance and the plan checks (about 6 minutes a
# release once its venv is in /var/cache/kvtrace; installing one takes 3 more)
compat: setup
	for v in $(VLLM); do bash scripts/setup-vllm $$v || exit 1; done
	bash scripts/setup-vllm-source $(NEWEST)
	KVTRACE_COMPAT="$(VLLM)" $(PY) -m pytest -q -rs tests/vllm/test_compat.py tests/vllm/test_plan.py

# The quick check (a few minutes): tests/unit without the slow ones; no server, no root needed
unit: setup
	$(PY) -m pytest -q -m "not slow" tests/unit

# The storage lab alone (tests/lab; `make test` runs it too): Debian's 6.1 kernel under QEMU
# with NVMe over PCIe, TCP and RDMA (soft-RoCE), kvtrace attached inside, checked against
# the kernel's own accounting.  Image cached in /var/cache/kvtrace/lab.
lab: setup
	$(PY) -m pytest -q -rs tests/lab
	@cat /var/cache/kvtrace/lab/last-run/timings.json 2>/dev/null && echo || true

bench: setup-vllm
	$(PY) bench/run.py

# Every benchmark in its short mode (about N minutes): that they still run, by hand
bench-short: setup-vllm
	$(PY) bench/run.py --short

# How the fleet report's cost grows with the hosts and the requests: `analyze` on DuckDB and Spark
# over 1 to 64 hosts synthesised from the recorded fleet run (tests/fleet/bench_fleet_scale.py;
# about 5 minutes on 2 idle CPUs, most of it Spark)
bench-fleet: setup
	$(PY) -m tests.fleet.bench_fleet_scale

# One shared-prefix workload on vLLM and on SGLang, each at two chunk sizes, attached and
# compared (docs/analysis.md, "vLLM against SGLang"; about 8 minutes)
engines: setup-vllm setup-sglang
	$(PY) bench/engines.py

clean:
	rm -rf $(VENV) build *.egg-info
