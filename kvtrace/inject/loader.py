"""The code that runs inside the target: a file exec'd by the injected one-liner.

Kept tiny and self-contained: no imports beyond the standard library and the staged hook,
and everything it does is reported to a result file, never raised into the target.
"""
from __future__ import annotations

import json

TEMPLATE = r'''
def _kvtrace_loader(hook_dir, result_path, action, owner, checked, module):
    import importlib, json, os, sys, time
    res = {"pid": os.getpid(), "t_ns": time.monotonic_ns(), "action": action}
    try:
        mod = sys.modules.get(module)
        res["reused"] = mod is not None
        if mod is None and action != "install":
            res["installed"] = False
            res["status"] = {"installed": False, "reason": "no kvtrace hook in this process"}
            mod = None
        elif mod is None:
            sys.path.insert(0, hook_dir)
            try:
                mod = importlib.import_module(module)
            finally:
                try:
                    sys.path.remove(hook_dir)
                except ValueError:
                    pass
        res["hook_file"] = getattr(mod, "__file__", "")
        if mod is None:
            pass
        elif action == "install":
            was = bool(mod.status().get("installed"))
            try:
                res["installed"] = bool(mod.install(live=True, checked=checked))
            except TypeError:  # a hook of an earlier kvtrace (a plugin's) takes no verdict
                res["installed"] = bool(mod.install(live=True))
            res["reused"] = was
            if res["installed"] and not was:
                mod.set_owner(owner)  # it leaves with its agent (0: stays; also forgets an earlier agent's)
        elif action == "uninstall":
            mod.uninstall()
            res["installed"] = False
        if mod is not None:
            res["status"] = mod.status()
    except BaseException as e:
        res["error"] = "%s: %s" % (type(e).__name__, e)
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, default=str)
    os.replace(tmp, result_path)
_kvtrace_loader(@HOOK_DIR@, @RESULT@, @ACTION@, @OWNER@, @CHECKED@, @MODULE@)
del _kvtrace_loader
'''


MODULES = {"vllm": "kvtrace.hook.vllm_hook", "sglang": "kvtrace.hook.sglang_hook"}


def render(hook_dir: str, result_path: str, action: str, owner: int = 0, checked: dict | None = None,
           engine: str = "vllm") -> str:
    """owner: the agent's pid; a hook this injection installs removes itself when it exits
    (a hook that was already there, e.g. the plugin's, stays).  checked: the agent's verdict
    on the target's source (kvtrace.hook.support.check), or None.  engine: whose hook module
    ("vllm", "sglang")."""
    return (TEMPLATE.replace("@HOOK_DIR@", json.dumps(hook_dir)).replace("@RESULT@", json.dumps(result_path))
            .replace("@MODULE@", json.dumps(MODULES[engine]))
            .replace("@ACTION@", json.dumps(action)).replace("@OWNER@", str(int(owner)))
            .replace("@CHECKED@", repr(_plain(checked))))


def _plain(checked: dict | None) -> dict | None:
    """What the hook reads of a verdict, as a Python literal (no JSON true/false/null)."""
    if not checked:
        return None
    return {"files": {k: list(v) for k, v in checked["files"].items()},
            "roles": {r: list(d) for r, d in checked["roles"].items()},
            "releases": {k: bool(v) for k, v in checked["releases"].items()}}
