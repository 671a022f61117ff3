"""The hook inside vLLM: class-level wrappers that turn scheduler, KV-cache and KV-connector
activity into kvtrace records (kvtrace.hook.wire), sent through one Transport per process.

Runs in vLLM's own interpreter: standard library plus what vLLM itself imports.  Loaded by the
``vllm.general_plugins`` entry point (kvtrace.hook.vllm.plugin) or by live injection
(kvtrace.inject.loader, from the files this module imports: kvtrace.inject.stage), which only
has to call ``install()``.  This module is the hook's face; its parts, by role (in
kvtrace/hook/vllm/ unless named from kvtrace/hook/):

  engine.py   EngineCore wrappers and state (S): Scheduler.schedule / update_from_output /
              _preempt_request, KVCacheManager.allocate_slots, BlockPool._maybe_evict_cached_block
  worker.py   Worker wrappers and state (W): the KV connector API (bind_connector_metadata,
              start_load_kv, wait_for_layer_load, wait_for_save), the delayed sender thread
  needs.py    what the hook needs of vLLM, target by target (methods, fields, attributes,
              calls); ../plan.py checks each kind, on vLLM's source (../source.py) and live
  releases.py what differs between supported releases, one row each, and its adapters
  support.py  the verdict for a vLLM source tree, as the agent gives it before injecting
  targets.py  what is patched in vLLM and with which wrapper, once a role's plan passes
  install.py  install / uninstall / status, roles by process
  ../state.py the Transport, the bounded record queue and its flush, agent and owner checks
  ../patch.py the patch registry

Rules: a wrapper never raises into vLLM (errors are counted and reported in hook_stats), never
blocks (records go to a bounded queue; full means counted drops), and while no agent is attached
costs one Transport.refresh() call (a time comparison) per step and one flag test per wrapped
call.  Prompt token ids are never read into a record: prompts appear only as block hashes.

A second copy of this file imported from its path under another name gets parts of its own (a
private package over kvtrace/hook/: own state and patch registry): its install() replaces the
first copy's wrappers instead of stacking on them, and its uninstall() restores vLLM's methods.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def _private_parts() -> str | None:
    """None when this module sits in a package of the hook's files (kvtrace.hook.vllm.hook);
    for a copy of this file imported from its path under another name, the name of a package
    of its own over kvtrace/hook/ (made once), whose modules the copy uses."""
    if __package__ and __name__ == __package__ + ".hook":
        return None
    name = __name__ + "_parts"
    if name not in sys.modules:
        top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        spec = importlib.util.spec_from_file_location(name, os.path.join(top, "__init__.py"),
                                                      submodule_search_locations=[top])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[name] = pkg
        spec.loader.exec_module(pkg)
    return name


_PRIVATE = _private_parts()
if _PRIVATE is None:
    from .. import state
    from . import engine, targets, worker
    from . import install as _install
else:
    state, engine, targets, worker, _install = (importlib.import_module(f"{_PRIVATE}.{m}") for m in
                                                ("state", "vllm.engine", "vllm.targets", "vllm.worker", "vllm.install"))

# The hook's interface (the plugin, the injector's loader, kvtrace.hook.api's sink)
install, uninstall, status, detect_roles = _install.install, _install.uninstall, _install.status, _install.detect_roles
set_owner, record_transfer = state.set_owner, state.record_transfer
HOOK_VERSION = state.HOOK_VERSION
# read-only here: engine.FLUSH_EVERY_NS and worker.FLUSH_EVERY_NS are the ones the wrappers read
FLUSH_EVERY_NS, FLUSH_RECORDS = state.FLUSH_EVERY_NS, state.FLUSH_RECORDS

# The state, and what tests/vllm/test_hook.py's self-test reaches for
T, S, W, _Q, _LOCK, _last, _flush = state.T, engine.S, worker.W, state._Q, state._LOCK, state._last, state._flush
_REGISTRY, _STATUS = state._REGISTRY, state._STATUS
_hot = engine._hot
CONNECTOR_METHODS, _patch_connector_class = targets.CONNECTOR_METHODS, targets._patch_connector_class
