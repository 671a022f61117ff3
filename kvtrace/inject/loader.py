"""The code that runs inside the target: a file exec'd by the injected one-liner.

Kept tiny and self-contained: no imports beyond the standard library and the staged hook,
and everything it does is reported to a result file, never raised into the target.
"""
from __future__ import annotations

import hashlib
import json

TEMPLATE = r'''
def _kvtrace_verified(files):
    # Every staged file read once and checked against the digest the agent sent in this very
    # code; modules then run from those bytes alone, never from a path.
    import hashlib, marshal
    code = {}
    for name, (path, digest, pkg, cpath, cdigest) in files.items():
        p, d = (cpath, cdigest) if cpath else (path, digest)
        with open(p, "rb") as f:
            b = f.read(1 << 22)
        if hashlib.sha256(b).hexdigest() != d:
            raise ImportError("the staged file %s is not the one kvtrace wrote" % p)
        code[name] = (path, marshal.loads(b) if cpath else compile(b, path, "exec", dont_inherit=True), pkg)
    return code


def _kvtrace_import(files, module):
    import importlib, importlib.abc, importlib.util, sys

    class KvtraceVerified(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        kvtrace_verified = True

        def __init__(self, code):
            self.code = code

        def find_spec(self, name, path=None, target=None):
            hit = self.code.get(name)
            return None if hit is None else importlib.util.spec_from_loader(name, self, origin=hit[0], is_package=hit[2])

        def create_module(self, spec):
            return None

        def exec_module(self, mod):
            path, code, _ = self.code[mod.__name__]
            mod.__file__ = path
            exec(code, mod.__dict__)

    pkg = sys.modules.get("kvtrace")
    if pkg is None or getattr(getattr(getattr(pkg, "__spec__", None), "loader", None), "kvtrace_verified", False):
        sys.meta_path.insert(0, KvtraceVerified(_kvtrace_verified(files)))
    return importlib.import_module(module)   # else: the target's own kvtrace (the plugin's)


def _kvtrace_loader(files, result_path, action, owner, checked, module):
    import json, os, sys, time
    res = {"pid": os.getpid(), "t_ns": time.monotonic_ns(), "action": action}
    try:
        mod = sys.modules.get(module)
        res["reused"] = mod is not None
        if mod is None and action != "install":
            res["installed"] = False
            res["status"] = {"installed": False, "reason": "no kvtrace hook in this process"}
        elif mod is None:
            mod = _kvtrace_import(files, module)
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
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(res, f, default=str)
    os.rename(tmp, result_path)
_kvtrace_loader(@FILES@, @RESULT@, @ACTION@, @OWNER@, @CHECKED@, @MODULE@)
'''

# Run by the injected one-liner (or by sys.remote_exec's script): the loader's own bytes are
# checked against their digest, which travels in the injected code, before they run, in a
# namespace of their own (nothing is left in the target's __main__).
BOOTSTRAP = ("(lambda h,p,d:(lambda b:exec(compile(b,p,'exec'),{'__name__':'kvtrace_loader'}) "
             "if h.sha256(b).hexdigest()==d else None)(open(p,'rb').read(1<<20)))(__import__('hashlib'),@PATH@,@DIGEST@)")


def render(files: dict, result_path: str, action: str, owner: int = 0, checked: dict | None = None,
           *, module: str) -> str:
    """The loader's code.  files: module name -> [path inside the target, sha256, is a package,
    bytecode path or "", its sha256] (kvtrace.inject.stage.Staged.files).  owner: the agent's pid;
    a hook this injection installs removes itself when it exits (a hook that was already there,
    e.g. the plugin's, stays).  checked: the agent's verdict on the target's source (the kind's
    support check), or None.  module: the hook module to import and run ``action`` of (the server
    kind's ``hook_module``; kvtrace.servers.kind)."""
    return (TEMPLATE.replace("@FILES@", repr({k: list(v) for k, v in files.items()}))
            .replace("@RESULT@", json.dumps(result_path)).replace("@MODULE@", json.dumps(module))
            .replace("@ACTION@", json.dumps(action)).replace("@OWNER@", str(int(owner)))
            .replace("@CHECKED@", repr(_plain(checked))))


def bootstrap(path: str, code: bytes) -> str:
    """The one line the target runs: check the loader at ``path`` against ``code``'s digest, run it."""
    return BOOTSTRAP.replace("@PATH@", repr(path)).replace("@DIGEST@", repr(hashlib.sha256(code).hexdigest()))


def _plain(checked: dict | None) -> dict | None:
    """What the hook reads of a verdict, as a Python literal (no JSON true/false/null)."""
    if not checked:
        return None
    return {"files": {k: list(v) for k, v in checked["files"].items()},
            "roles": {r: list(d) for r, d in checked["roles"].items()},
            "releases": {k: bool(v) for k, v in checked["releases"].items()}}
