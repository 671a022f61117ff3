"""Start and stop a real vLLM server (CPU build) with a tiny random-weight Llama (or, for
the overhead benchmark, a larger one: MODELS).

Used by `kvtrace demo` and by the tests.  vLLM lives in its own venv (its interpreter is
found from $KVTRACE_VLLM_PYTHON, default /var/cache/kvtrace/vllm-venv/bin/python); the model
is a config.json only (--load-format dummy, --skip-tokenizer-init), so nothing is fetched.
Prompts are token-id lists.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

DEFAULT_PYTHON = "/var/cache/kvtrace/vllm-venv/bin/python"
DEFAULT_RELEASE = "0.32.0"   # the release scripts/setup-vllm installs into the default venv
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}
# 8 layers of width 1024 (about 155M parameters): a step costs this VM 3-4 times the CPU of the
# tiny model's, most of it the model's own arithmetic rather than vLLM's Python around it
SMALL_LLAMA = {**TINY_LLAMA, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
               "num_attention_heads": 16, "num_key_value_heads": 4}
# A hybrid model: Gemma 3's layout at the tiny model's width, one sliding-window layer (a 64-token
# window) and one full-attention layer, so vLLM makes two KV cache groups
TINY_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 32000,
    "max_position_embeddings": 8192, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 64, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None, "attn_logit_softcapping": None,
}
MODELS = {"tiny": TINY_LLAMA, "small": SMALL_LLAMA}    # the benchmarks' presets (bench/overhead.py --model)
SERVABLE = {**MODELS, "hybrid": TINY_GEMMA3}


def vllm_python() -> str:
    """$KVTRACE_VLLM_PYTHON, else $KVTRACE_VLLM_VENV/bin/python, else the default venv's."""
    if os.environ.get("KVTRACE_VLLM_PYTHON"):
        return os.environ["KVTRACE_VLLM_PYTHON"]
    if os.environ.get("KVTRACE_VLLM_VENV"):
        return os.path.join(os.environ["KVTRACE_VLLM_VENV"], "bin", "python")
    return DEFAULT_PYTHON


def release_python(version: str) -> str:
    """The interpreter of the venv ``scripts/setup-vllm VERSION`` makes for a vLLM release."""
    if version == DEFAULT_RELEASE:
        return DEFAULT_PYTHON
    return f"/var/cache/kvtrace/vllm-{version}-venv/bin/python"


def write_tiny_model(directory: str | os.PathLike, config: dict = TINY_LLAMA) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


def demo_args(work: str | os.PathLike, kv_events_port: int) -> list[str]:
    """vLLM arguments of the demo's server: 32-token blocks, prefix caching, a 256-token chunk
    budget, a 122-block cache (small enough to evict), KV events published on
    ``kv_events_port``, and kvtrace's file connector storing blocks under ``work``/kv-blocks."""
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{kv_events_port}"}
    connector = {"kv_connector": "KvtraceFileConnector", "kv_role": "kv_both",
                 "kv_connector_module_path": "kvtrace.hook.vllm.fileconnector",
                 "kv_connector_extra_config": {"path": str(Path(work) / "kv-blocks")}}
    return ["--block-size", "32", "--enable-prefix-caching", "--max-num-batched-tokens", "256",
            "--num-gpu-blocks-override", "122", "--max-model-len", "2048", "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_events), "--kv-transfer-config", json.dumps(connector)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    """A vLLM OpenAI server on 127.0.0.1:port; ``start()`` waits until it answers."""

    ENGINE = "vLLM"

    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    python: str = field(default_factory=vllm_python)
    workdir: Path | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    model_name: str = "tiny"   # a key of SERVABLE
    cgroup: str | None = None  # a cgroup (v1 or v2 directory) to start the server in, e.g. a blkio one

    def start(self, timeout: float = 600.0) -> "VllmServer":
        self.port = self.port or free_port()
        self.workdir = Path(self.workdir or tempfile.mkdtemp(prefix="kvtrace-vllm-"))
        if self.model_name not in SERVABLE:
            raise ValueError(f"no model {self.model_name!r}: use one of {', '.join(SERVABLE)}")
        model = write_tiny_model(self.workdir / f"{self.model_name}-llama", SERVABLE[self.model_name])
        self.model = str(model)
        self.log_path = self.workdir / "server.log"
        cmd = self.command()
        # The agent's PYTHONPATH is not the server's; a caller may still give one through env.
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        env.update(self.base_env())
        env.update(self.env)
        log = open(self.log_path, "wb")
        join = None
        if self.cgroup:
            procs = os.path.join(self.cgroup, "cgroup.procs")

            def join() -> None:   # in the child, before exec: it and every process it starts are in the cgroup
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=self.workdir, start_new_session=True, preexec_fn=join)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.ENGINE} exited with {self.proc.returncode}; see {self.log_path}:\n" + self.tail())
            if self._failed():   # some releases hang on shutdown after a failed engine start
                self.stop()
                raise RuntimeError(f"{self.ENGINE}'s engine failed to start; see {self.log_path}:\n" + self.tail())
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.ENGINE} did not answer within {timeout:.0f}s; see {self.log_path}")

    def _failed(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(os.fstat(f.fileno()).st_size - 65536, 0))
                return b"Engine core initialization failed" in f.read()
        except OSError:
            return False

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--load-format", "dummy", "--skip-tokenizer-init", "--host", "127.0.0.1",
                "--port", str(self.port), "--max-model-len", "4096", *self.args]

    def base_env(self) -> dict[str, str]:
        # VLLM_CPU_KVCACHE_SPACE (whole GiB) keeps the CPU worker from reserving a fraction of all
        # memory at start; it also overrides --kv-cache-memory-bytes, so size small caches with
        # --num-gpu-blocks-override.  Callers may override it through env.
        return {"VLLM_CPU_KVCACHE_SPACE": "1"}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def processes(self) -> dict[str, list[int]]:
        """{'api': [pid], 'engine': [...], 'workers': [...]} by process title."""
        return processes_by_title(self.proc.pid, {"VLLM::EngineCor": "engine", "VLLM::Worker": "workers"})

    def complete(self, prompt: list[int], max_tokens: int = 4, **extra) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        req = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def processes_by_title(pid: int, titles: dict[str, str]) -> dict[str, list[int]]:
    """{'api': [pid], key: [descendant pids]...}: each descendant filed under the key of the title
    prefix its name starts with (the title the engine sets, cut to 15 characters)."""
    api = psutil.Process(pid)
    out = {"api": [api.pid], "engine": [], "workers": [], **{k: [] for k in titles.values()}}
    for c in api.children(recursive=True):
        try:
            name = c.name()
        except psutil.Error:
            continue
        for prefix, key in titles.items():
            if name.startswith(prefix):
                out[key].append(c.pid)
                break
    return out
