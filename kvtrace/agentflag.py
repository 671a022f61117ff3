"""The agent's presence, as the hook inside vLLM sees it: a file named by the agent's pid in
the flag directory (several agents may be attached at once).

Written while the agent captures user records and removed at exit; a SIGKILLed agent
leaves a stale file, which the hook ignores because the pid is no longer alive.
"""
from __future__ import annotations

import os

from kvtrace.hook.transport import FLAG_PATH


class AgentFlag:
    def __init__(self, path: str = FLAG_PATH):
        self.dir = path
        self.path = os.path.join(path, str(os.getpid()))

    def __enter__(self) -> "AgentFlag":
        if os.path.isfile(self.dir):  # the single-file flag of an older kvtrace
            os.unlink(self.dir)
        os.makedirs(self.dir, mode=0o755, exist_ok=True)
        with open(self.path, "w") as f:
            f.write(f"{os.getpid()}\n")
        return self

    def __exit__(self, *exc) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass
