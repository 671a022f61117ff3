"""The hook inside vLLM: class-level wrappers that turn scheduler, KV-cache and KV-connector
activity into kvtrace records (kvtrace.hook.wire), sent through one Transport per process.

Runs in vLLM's own interpreter: standard library plus what vLLM itself imports.  Loaded by the
``vllm.general_plugins`` entry point (kvtrace.hook.plugin) or imported from a path by live
injection (kvtrace.inject.loader), which only has to call ``install()``.  This module is the
hook's face; its parts, by role:

  state.py    the Transport, the bounded record queue and its flush, the engine's and the
              worker's state (S, W), agent and owner checks
  engine.py   EngineCore wrappers: Scheduler.schedule / update_from_output / _preempt_request,
              KVCacheManager.allocate_slots, BlockPool._maybe_evict_cached_block
  worker.py   Worker wrappers: the KV connector API (bind_connector_metadata, start_load_kv,
              wait_for_layer_load, wait_for_save) and the Worker's delayed sender thread
  needs.py    what the hook needs of vLLM, target by target (methods, fields, attributes,
              calls); plan.py checks each kind, on vLLM's source (source.py) and live
  releases.py what differs between supported releases, one row each, and its adapters
  support.py  the verdict for a vLLM source tree, as the agent gives it before injecting
  targets.py  what is patched in vLLM and with which wrapper, once a role's plan passes
  patch.py    the patch registry
  install.py  install / uninstall / status, roles by process

Rules: a wrapper never raises into vLLM (errors are counted and reported in hook_stats), never
blocks (records go to a bounded queue; full means counted drops), and while no agent is attached
costs one Transport.refresh() call (a time comparison) per step and one flag test per wrapped
call.  Prompt token ids are never read into a record: prompts appear only as block hashes.

A second copy of this file imported from its path under another name gets parts of its own
(own state and patch registry, as when the hook was one module): its install() replaces the
first copy's wrappers instead of stacking on them, and its uninstall() restores vLLM's methods.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def _parts() -> str:
    """The package holding this module's parts: kvtrace.hook, or for a copy imported under
    another name, a package of its own over this file's directory."""
    if __package__ and __name__ == __package__ + ".vllm_hook":
        return __package__
    name = __name__ + "_parts"
    if name not in sys.modules:
        here = os.path.dirname(os.path.abspath(__file__))
        spec = importlib.util.spec_from_file_location(name, os.path.join(here, "__init__.py"),
                                                      submodule_search_locations=[here])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[name] = pkg
        spec.loader.exec_module(pkg)
    return name


_PKG = _parts()
state = importlib.import_module(_PKG + ".state")
engine = importlib.import_module(_PKG + ".engine")
worker = importlib.import_module(_PKG + ".worker")
targets = importlib.import_module(_PKG + ".targets")
_install = importlib.import_module(_PKG + ".install")

# The hook's interface (the plugin, the injector's loader, kvtrace.hook.api's sink)
install, uninstall, status, detect_roles = _install.install, _install.uninstall, _install.status, _install.detect_roles
set_owner, record_transfer = state.set_owner, state.record_transfer
HOOK_VERSION = state.HOOK_VERSION
# read-only here: engine.FLUSH_EVERY_NS and worker.FLUSH_EVERY_NS are the ones the wrappers read
FLUSH_EVERY_NS, FLUSH_RECORDS = state.FLUSH_EVERY_NS, state.FLUSH_RECORDS

# The shared state, and what tests/vllm/test_hook.py's self-test reaches for
T, S, W, _Q, _LOCK, _last, _flush = state.T, state.S, state.W, state._Q, state._LOCK, state._last, state._flush
_REGISTRY, _STATUS = state._REGISTRY, state._STATUS
_hot = engine._hot
CONNECTOR_METHODS, _patch_connector_class = targets.CONNECTOR_METHODS, targets._patch_connector_class
