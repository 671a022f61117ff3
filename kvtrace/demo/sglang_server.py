"""Start and stop a real SGLang server (CPU engine) with the same tiny random-weight Llama as the
vLLM one (kvtrace.demo.server), for the tests and `kvtrace demo --engine sglang`.

SGLang lives in its own venv (scripts/setup-sglang; $KVTRACE_SGLANG_PYTHON, default
/var/cache/kvtrace/sglang-venv/bin/python).  Its CPU engine imports `sgl_kernel`, which the
registry has only as CUDA builds: ``stub`` names a directory put on the server's PYTHONPATH
with a stand-in (the tests' tests/sglang/stub).  Prompts are token-id lists sent to /generate
(its OpenAI completions endpoint needs a tokenizer).
"""
from __future__ import annotations

import json
import os
import urllib.request
from dataclasses import dataclass, field

from kvtrace.demo.server import VllmServer, processes_by_title

DEFAULT_PYTHON = "/var/cache/kvtrace/sglang-venv/bin/python"
CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule", "--enable-metrics"]


def sglang_python() -> str:
    return os.environ.get("KVTRACE_SGLANG_PYTHON") or DEFAULT_PYTHON


@dataclass
class SglangServer(VllmServer):
    """An SGLang server on 127.0.0.1:port; ``start()`` waits until it answers /health."""

    ENGINE = "SGLang"

    python: str = field(default_factory=sglang_python)
    stub: str | None = None        # a directory holding the sgl_kernel stand-in, put on PYTHONPATH

    def command(self) -> list[str]:
        return [self.python, "-m", "sglang.launch_server", "--model-path", self.model, "--load-format", "dummy",
                "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(self.port), *CPU_ARGS, *self.args]

    def base_env(self) -> dict[str, str]:
        env = {"SGLANG_USE_CPU_ENGINE": "1"}
        if self.stub:
            env["PYTHONPATH"] = self.stub
        return env

    def processes(self) -> dict[str, list[int]]:
        """{'api': [launcher pid], 'engine': [the schedulers], 'workers': []} by process title
        (SGLang's TP=1 scheduler runs the model itself)."""
        return processes_by_title(self.proc.pid, {"sglang::schedul": "engine", "sglang::detoken": "detokenizer"})

    def generate(self, input_ids: list[int], max_new_tokens: int = 4, rid: str | None = None, **sampling) -> dict:
        """POST /generate with token ids (greedy); the decoded answer (meta_info.cached_tokens...)."""
        body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling}}
        if rid:
            body["rid"] = rid
        req = urllib.request.Request(f"{self.url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def complete(self, prompt: list[int], max_tokens: int = 4, **extra) -> dict:
        return self.generate(prompt, max_tokens, **extra)
