"""The agent's presence, as the hook inside vLLM sees it: a flag file naming the agent's pid.

Written while the agent captures user records and removed at exit; a SIGKILLed agent
leaves a stale file, which the hook ignores because the pid is no longer alive.
"""
from __future__ import annotations

import os

from kvtrace.hook.transport import FLAG_PATH


class AgentFlag:
    def __init__(self, path: str = FLAG_PATH):
        self.path = path

    def __enter__(self) -> "AgentFlag":
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(tmp, self.path)
        return self

    def __exit__(self, *exc) -> None:
        try:
            with open(self.path) as f:
                if f.read().split()[0] == str(os.getpid()):
                    os.unlink(self.path)
        except (OSError, IndexError):
            pass
