"""`kvtrace demo`: the main job on an embedded default, end to end, with its own check.

Default: a real vLLM CPU server (tiny random-weight Llama; chunked prefill with a 256-token
budget, prefix caching, 32-token blocks, a KV cache small enough to evict, KV events on, the
file-backed KV connector), ``kvtrace attach --port`` injecting the hook live, a shared-prefix
workload that forces chunked prefill, prefix hits, evictions and loads back from storage,
then the report, and kvtrace's numbers beside vLLM's own answers.

``--io``: a loop device, a built-in workload that reads it with O_DIRECT and io_uring,
``kvtrace attach`` on it, the summary, and the workload's own account beside kvtrace's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from kvtrace.errors import CaptureError, KvtraceError, PrivilegeError


def _sh(*cmd: str) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise CaptureError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
    return p.stdout.strip()


def io_demo(out: Path, chunk: int = 131072, count: int = 64) -> int:
    from kvtrace.dataset.reader import Dataset  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    with tempfile.TemporaryDirectory(prefix="kvtrace-demo-") as tmp:
        img = Path(tmp) / "kv.img"
        with open(img, "wb") as f:
            f.truncate(count * chunk)
        dev = _sh("losetup", "--find", "--show", "--direct-io=on", str(img))
        try:
            result = Path(tmp) / "workload.json"
            cmd = [sys.executable, "-m", "kvtrace", "attach", "--out", str(out), "--",
                   sys.executable, "-m", "kvtrace.demo.io", "mixed", "--path", dev,
                   "--chunk", str(chunk), "--count", str(count), "--result", str(result)]
            if subprocess.run(cmd).returncode:
                raise CaptureError("kvtrace attach failed (see above)")
            truth = json.loads(result.read_text())
        finally:
            subprocess.run(["losetup", "-d", dev])
    ds = Dataset.open(out)
    disk = os.path.basename(dev)
    block = [r for r in ds.table("block_io").to_pylist() if r["disk"] == disk and r["pid"] == truth["pid"]]
    ring = [r for r in ds.table("io_uring").to_pylist() if r["op"] == "READ"]
    checks = [
        ("block requests", len(block), truth["calls"]),
        ("block bytes", sum(r["bytes"] for r in block), truth["bytes"]),
        ("io_uring reads", len(ring), truth["uring"]["calls"]),
        ("io_uring bytes", sum(r["bytes"] for r in ring), truth["uring"]["bytes"]),
    ]
    click.echo("\nkvtrace demo: what kvtrace recorded vs what the workload did")
    ok = True
    for name, got, want in checks:
        ok &= got == want
        click.echo(f"  {name:16} kvtrace {got:>12,}   workload {want:>12,}   {'ok' if got == want else 'MISMATCH'}")
    return 0 if ok else 1


def vllm_demo(out: Path) -> int:
    import signal
    import time

    from kvtrace.dataset.reader import Dataset  # lazy: start-up cost: the CLI imports every command's module (cli._register)
    from kvtrace.demo import workload  # lazy: start-up cost: the CLI imports every command's module (cli._register)
    from kvtrace.demo.server import VllmServer, demo_args, free_port  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    work = Path(tempfile.mkdtemp(prefix="kvtrace-demo-vllm-"))
    zport = free_port()
    args = demo_args(work, zport)
    click.echo("kvtrace demo: starting a vLLM CPU server (tiny random-weight Llama; about a minute)...")
    server = VllmServer(args=args, env={"VLLM_PLUGINS": ""}, workdir=work)
    try:
        server.start()
    except (RuntimeError, OSError) as e:
        raise KvtraceError(f"the demo's vLLM server did not start ({server_error(e, server)}); "
                           f"its log: {server.log_path}") from None
    try:
        click.echo(f"kvtrace demo: vLLM serving on {server.url}; attaching (live injection, no restart)")
        agent = subprocess.Popen([sys.executable, "-m", "kvtrace", "attach", "--quiet", "--port", str(server.port),
                                  "--out", str(out)], stderr=subprocess.PIPE, text=True)
        for line in agent.stderr:
            sys.stderr.write(line)
            if "vLLM hook" in line or "vLLM signals missing" in line:
                break
            if agent.poll() is not None:
                raise CaptureError("kvtrace attach exited early (see above)")
        reqs = workload.shared_prefix(seed=1, groups=3, per_group=3, prefix_len=640, suffix_len=360,
                                      fillers=3, filler_len=1000)
        click.echo(f"kvtrace demo: sending {len(reqs)} requests (3 groups sharing 640-token prefixes, fillers that evict, "
                   "then the first prompt again, now loaded back from storage)")
        results = workload.run(server.url, server.model, reqs)
        time.sleep(1.5)
        agent.send_signal(signal.SIGINT)
        _, err = agent.communicate(timeout=120)
        sys.stderr.write(err)
        if agent.returncode:
            raise CaptureError(f"kvtrace attach failed with exit {agent.returncode}")
    finally:
        server.stop()
    return vllm_report(Dataset.open(out), results)


def server_error(e: Exception, server) -> str:
    """The last error line vLLM logged, else the exception's first line."""
    lines = [ln for ln in server.tail(200).splitlines() if "Error" in ln or "error:" in ln]
    return (lines[-1].split(") ", 1)[-1].strip() if lines else str(e).splitlines()[0])[:300]


def vllm_report(ds, results) -> int:
    """Per request: vLLM's answer beside kvtrace's record of the same request."""
    admits = {a["request"]: a for a in ds.table("admit").to_pylist() if not a["attempt"]}
    chunks = ds.table("chunk").to_pylist()
    evicts = ds.table("evict").to_pylist()
    loads = ds.table("kv_load").to_pylist() if "kv_load" in ds.names() else []
    click.echo("\nkvtrace demo: each request as vLLM answered it and as kvtrace recorded it")
    click.echo(f"  {'request':14} {'prompt':>6} {'vLLM cached':>11} {'kvtrace local+ext':>17} {'chunks':>6} "
               f"{'evictions caused':>16} {'KV loaded':>10}  check")
    ok = True
    for r in results:
        req = next((k for k in admits if k.startswith(f"cmpl-{r.rid}-")), None)
        a = admits.get(req, {})
        mine = [c for c in chunks if c["request"] == req]
        ev = sum(1 for e in evicts if e["request"] == req)
        loaded = sum(l["nbytes"] for l in loads if l["request"] == req)
        got = (a.get("cached_local", 0) + a.get("cached_external", 0)) if a else None
        good = got == r.cached_tokens and not r.error
        ok &= good
        split = "-" if got is None else f"{a['cached_local']}+{a['cached_external']}"
        click.echo(f"  {r.rid:14} {r.prompt_tokens:>6} {r.cached_tokens:>11} {split:>17} {len(mine):>6} {ev:>16} "
                   f"{loaded:>10,}  {'ok' if good else 'MISMATCH'}")
    return 0 if ok else 1


@click.command("demo")
@click.option("--io", "io_only", is_flag=True, help="Run the built-in I/O workload demo instead of the vLLM one.")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Where to keep the dataset (default: a new temp dir).")
def command(io_only: bool, out: str | None) -> int:
    """Run the main job on an embedded default and print its report."""
    if os.geteuid() != 0:
        raise PrivilegeError("the demo attaches BPF probes and makes a loop device: run it with sudo")
    out_dir = Path(out or tempfile.mkdtemp(prefix="kvtrace-demo-ds-"))
    rc = io_demo(out_dir) if io_only else vllm_demo(out_dir)
    click.echo(f"dataset: {out_dir} (read it again with: kvtrace summary {out_dir})")
    return rc
