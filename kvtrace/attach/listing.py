"""The table of vLLM and SGLang servers that `kvtrace servers` prints and `attach` shows when it must
ask which server to trace."""
from __future__ import annotations

import os
from kvtrace.analysis.render import Col, Term
from kvtrace.servers import registry

def kv_label(info) -> str:
    kv = info.kv_events
    if kv is None or not kv.enabled:
        return "off"
    out = kv.endpoint or "?"
    if kv.replay_endpoint:
        out += f" replay {kv.replay_endpoint}"
    if kv.dp_size > 1:
        out += f" ({kv.dp_size} DP ranks: port + rank)"
    return out


def engine(info) -> str:
    """"vLLM 0.32.0", "SGLang 0.5.23"."""
    return f"{registry.kind(info.kind).title} {info.version or '?'}"


def where(info) -> str:
    """' [container]' / ' [netns net:[…]]' when the server lives apart from kvtrace."""
    tags = ["container"] if info.in_container else []
    if info.netns:
        tags.append(f"own network {info.netns_id}")
    return f" [{', '.join(tags)}]" if tags else ""


def _console(stderr: bool):
    from rich.console import Console

    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=200)


def render(servers, console=None, hooks: list[str] | None = None) -> None:
    """The servers as a rich table (to stderr by default, so stdout stays clean for pipes),
    fitted to the console's width: the least needed columns go first (Python, then the Worker
    and EngineCore pids; `kvtrace servers --json` has them all), then endpoints and models fold.
    ``hooks``: whether the hook supports each server's vLLM ("yes", "no", "?")."""

    console = console or _console(stderr=True)
    cols = [Col("API pid", justify="left", wrap="word"), Col("port", justify="left"),
            Col("EngineCore", 3, justify="left", wrap="word"), Col("Workers", 3, justify="left", wrap="word"),
            Col("Python", 4, justify="left"), Col("engine", 1, justify="left", wrap="word"), Col("hook", 1, justify="left"),
            Col("plugin", 2, justify="left"),
            Col("KV events", 1, justify="left", wrap="fold"), Col("model", justify="left", wrap="fold")]
    rows = [[" ".join(map(str, s.api_pids)), str(s.port) if s.port is not None else "-",
             " ".join(map(str, s.engine_pids)) or "-", " ".join(map(str, s.worker_pids)) or "-",
             s.python_version or "?", engine(s), h, {"installed": "yes", "absent": "no"}.get(s.plugin, s.plugin),
             kv_label(s), (os.path.basename((s.model or "?").rstrip("/")) or s.model) + where(s)]
            for s, h in zip(servers, hooks or ["?"] * len(servers))]
    Term(console, hint="kvtrace servers --json shows them").table(f"LLM servers ({len(servers)})", cols, rows,
                                                                   title_justify="left")
