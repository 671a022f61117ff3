# The two commands README.md gives (run as root on a fresh machine):
#   sudo make demo   - set up, start a real tiny vLLM, attach, drive a workload, report
#   sudo make test   - set up, then run every test (privileged ones included)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-vllm demo test unit lab bench bench-short clean

setup:
	bash scripts/setup-host

setup-vllm: setup
	bash scripts/setup-vllm

demo: setup-vllm
	$(VENV)/bin/kvtrace demo

test: setup-vllm
	$(PY) -m pytest -q -rs tests
	$(PY) bench/run.py --short

unit: setup
	$(PY) -m pytest -q tests/unit

# The storage lab alone (tests/lab; `make test` runs it too): Debian's 6.1 kernel under QEMU
# with NVMe over PCIe, TCP and RDMA (soft-RoCE), kvtrace attached inside, checked against
# the kernel's own accounting.  Image cached in /var/cache/kvtrace/lab.
lab: setup
	$(PY) -m pytest -q -rs tests/lab
	@cat /var/cache/kvtrace/lab/last-run/timings.json 2>/dev/null && echo || true

bench: setup-vllm
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) build *.egg-info
