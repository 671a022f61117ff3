"""A vLLM KV connector that keeps whole KV blocks in files, one file per block.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvtraceFileConnector",
                           "kv_role": "kv_both",
                           "kv_connector_module_path": "kvtrace.hook.vllm.fileconnector",
                           "kv_connector_extra_config": {"path": "/var/tmp/kvblocks"}}'

It runs inside vLLM (its own interpreter: standard library + torch + vllm), in two halves:

* Scheduler half (EngineCore process).  After the local prefix-cache hit, it counts how many
  further full blocks of the request have a file of the right size under ``path`` and reports
  them as external matched tokens (never the whole prompt: vLLM recomputes the last token).
  Every step it plans two lists for the worker: blocks to load (request admitted this step
  with an external hit) and blocks to store (every full block whose last token is computed in
  this step).
* Worker half (Worker process).  Loads are synchronous, before the forward: open the block's
  file, ``preadv`` it into a staging buffer, copy each layer's slice into the KV cache tensor
  at the allocated block id.  Stores run in ``wait_for_save`` after the forward: copy the
  block's slice of every layer into the staging buffer, write it to a temporary file, rename.

File format (see docs/fileconnector.md): the file name is the block's chained prefix hash
(vLLM's ``request.block_hashes[i]``, lower-case hex); the content is, for each KV layer in
vLLM's order (``layout.json`` lists them), that layer's block slice ``kv_cache[block_id]`` in
C order, with no header.  ``path/layout.json`` records the model and layout the files belong
to; a directory written for another layout is refused at start-up.

The store path never raises into vLLM (errors are counted).  A block that cannot be loaded
(missing, wrong size, read error) is reported through ``get_block_ids_with_load_errors`` and
vLLM recomputes from that block (the connector sets ``kv_load_failure_policy`` to
``recompute``); stores of that request in the same step are skipped, since its forward ran
on an incomplete prefix.

This is one module, a little over the tree's 500-line guide, on purpose.  vLLM imports it by
``kv_connector_module_path`` into its own interpreter.  There, only kvtrace.hook may be imported
from kvtrace (tests/unit/test_packaging.py checks this).  The name it was first published under,
kvtrace.hook.fileconnector, still loads it (a shim until kvtrace 0.2.0).
"""
from __future__ import annotations

import json
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from .. import plan
from ..source import SourceTree
from . import needs, releases

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

try:  # optional: kvtrace's in-process hook; a no-op unless the hook is installed and an agent attached
    from kvtrace.hook import api as _hook_api
except ImportError:  # pragma: no cover - depends on what is installed beside vLLM
    _hook_api = None
HOOK_SOURCE = "kvtrace-file"

logger = init_logger("vllm.kvtrace_fileconnector")  # under "vllm" so vLLM's log config applies

FORMAT = "kvtrace-kv-block/1"
LAYOUT_FILE = "layout.json"
TMP_SUFFIX = ".tmp"


# ---------------------------------------------------------------------------------------
# Metadata passed scheduler -> worker each step (pickled by vLLM with the SchedulerOutput)


@dataclass
class BlockTransfer:
    """Blocks of one request to move this step: (block id, hex hash) pairs in prefix order."""

    req_id: str
    blocks: list[tuple[int, str]]


@dataclass
class FileConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    stores: list[BlockTransfer] = field(default_factory=list)


# ---------------------------------------------------------------------------------------
# Layout shared by both halves (computed from the same vLLM config, so they agree)


def block_layout(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> dict:
    """What one block file holds; raises ValueError for a configuration it cannot store."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"KvtraceFileConnector supports one KV cache group, this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"KvtraceFileConnector supports attention KV caches, not {type(spec).__name__}")
    block_size = vllm_config.cache_config.block_size
    if spec.block_size != block_size:
        raise ValueError(f"KV spec block size {spec.block_size} != cache block size {block_size}")
    hash_bs = releases.hash_block_size(kv_cache_config)
    if hash_bs not in (None, block_size):
        raise ValueError(f"prefix-hash block size {hash_bs} != block size {block_size}")
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size != 1:
        raise ValueError("KvtraceFileConnector supports one pipeline stage (PP=1)")
    group_layers = set(groups[0].layer_names)
    layers = [n for t in kv_cache_config.kv_cache_tensors for n in releases.layer_names(t) if n in group_layers]
    if not layers:
        raise ValueError("no KV cache layers to store")
    page = releases.page_bytes(spec)
    return {
        "format": FORMAT,
        "model": str(vllm_config.model_config.model),
        "dtype": str(spec.dtype).removeprefix("torch."),
        "block_size": block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "head_size_v": releases.value_head_size(spec),
        "kv_cache_layout": releases.layout_name(kv_cache_config),
        "layers": layers,
        "layer_block_bytes": page,
        "block_bytes": page * len(layers),
        # tensor parallel: each rank stores its share of the KV heads in a file of its own
        **({"tp_size": par.tensor_parallel_size} if par.tensor_parallel_size > 1 else {}),
    }


def check_layout(directory: str, layout: dict) -> None:
    """Write path/layout.json, or check that the one there describes the same layout."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LAYOUT_FILE)
    text = json.dumps(layout, indent=1, sort_keys=True) + "\n"
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}{TMP_SUFFIX}"
        with open(tmp, "w") as f:
            f.write(text)
        try:
            os.link(tmp, path)  # fails if the other half got there first: then compare
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    with open(path) as f:
        found = json.load(f)
    if found != layout:
        diff = sorted(k for k in set(found) | set(layout) if found.get(k) != layout.get(k))
        raise ValueError(
            f"{path} describes another KV layout (differs in {', '.join(diff)}); "
            "give KvtraceFileConnector an empty or matching directory"
        )


class _Stats:
    """Counters, optionally mirrored to <stats_dir>/<role>.json (tmp + rename)."""

    def __init__(self, stats_dir: str | None, role: str):
        self.path = os.path.join(stats_dir, f"{role}.json") if stats_dir else None
        self.c: dict[str, Any] = {"pid": os.getpid()}
        self.dirty = False
        if self.path:
            os.makedirs(stats_dir, exist_ok=True)
            self.flush(force=True)

    def add(self, **kv: int) -> None:
        for k, v in kv.items():
            self.c[k] = self.c.get(k, 0) + v
        self.dirty = True

    def error(self, key: str, exc: BaseException) -> None:
        self.add(**{key: 1})
        self.c["last_error"] = f"{key}: {type(exc).__name__}: {exc}"[:500]

    def flush(self, force: bool = False) -> None:
        if not self.path or not (self.dirty or force):
            return
        self.dirty = False
        try:
            tmp = f"{self.path}{TMP_SUFFIX}"
            with open(tmp, "w") as f:
                json.dump(self.c, f, sort_keys=True)
            os.rename(tmp, self.path)
        except OSError:
            self.c["stats_errors"] = self.c.get("stats_errors", 0) + 1


_CHECKED: list[str] = []


def refuse_unsupported_vllm() -> None:
    """Raise, naming the first thing that differs, when this vLLM lacks what the connector needs
    (kvtrace.hook.vllm.needs.FILE_CONNECTOR and the rows of kvtrace.hook.vllm.releases); checked once."""
    if not _CHECKED:
        src = SourceTree.of_imported_vllm()
        bad = plan.differences(needs.FILE_CONNECTOR, src) + releases.forms(src, releases.CONNECTOR_ROWS)[1]
        _CHECKED.append(bad[0] if bad else "")
    if _CHECKED[0]:
        import vllm

        raise ValueError(f"KvtraceFileConnector does not support vLLM {vllm.__version__}: {_CHECKED[0]}")


def _report(direction: str, req_id: str, blocks: int, nbytes: int, t0: int, t1: int, stats: _Stats) -> None:
    if _hook_api is None or blocks == 0:
        return
    try:
        _hook_api.kv_transfer(direction, req_id, blocks, nbytes, t0, t1, source=HOOK_SOURCE)
    except Exception as e:  # the hook must never break serving
        stats.error("hook_errors", e)


def block_rows(kv: "torch.Tensor", num_blocks: int) -> int | None:
    """How a layer's KV tensor holds its blocks: the rows of dim 0 per block when blocks are
    outermost (vLLM's CPU backend since 0.24), 0 when K and V are outermost and blocks are dim
    1 (shape (2, num_blocks, ...): the CPU backend before), None when neither."""
    rows, rem = divmod(kv.shape[0], num_blocks)
    if rows >= 1 and not rem:
        return rows
    if kv.dim() >= 2 and kv.shape[0] == 2 and kv.shape[1] == num_blocks:
        return 0
    return None


# ---------------------------------------------------------------------------------------


class KvtraceFileConnector(KVConnectorBase_V1):
    """File-backed KV block store (see the module docstring)."""

    _cache_hit_source = releases.cache_hit_source("DISK")   # used by vLLM 0.32+ only

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        refuse_unsupported_vllm()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        path = cfg.get_from_extra_config("path", None)
        if not path:
            raise ValueError('KvtraceFileConnector needs kv_connector_extra_config {"path": DIR}')
        self.dir = os.path.abspath(str(path))
        self.fsync = bool(cfg.get_from_extra_config("fsync", False))
        # O_DIRECT reads: every load reaches the device (a storage tier measured, not the page cache)
        self.direct = bool(cfg.get_from_extra_config("direct_io", False))
        self.layout = block_layout(vllm_config, kv_cache_config)
        check_layout(self.dir, self.layout)
        self.block_size = self.layout["block_size"]
        self.block_bytes = self.layout["block_bytes"]
        self.num_blocks = kv_cache_config.num_blocks
        self.do_load = cfg.is_kv_consumer
        self.do_store = cfg.is_kv_producer
        self.tp = int(self.layout.get("tp_size", 1))
        self.rank = 0
        stats_dir = cfg.get_from_extra_config("stats_dir", None)

        if role == KVConnectorRole.SCHEDULER:
            self.stats = _Stats(stats_dir, "scheduler")
            # A block that cannot be read must be recomputed, not fail the request.
            if cfg.kv_load_failure_policy != "recompute":
                logger.info("KvtraceFileConnector: kv_load_failure_policy %s -> recompute",
                            cfg.kv_load_failure_policy)
                cfg.kv_load_failure_policy = "recompute"
            self._requests: dict[str, Request] = {}
            self._lookup: dict[str, int] = {}  # req_id -> first block index of the external hit
            self._loads: list[BlockTransfer] = []
            self._tracked = releases.block_ids_source()
        else:
            if self.tp > 1:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                self.rank = get_tensor_model_parallel_rank()
            self.stats = _Stats(stats_dir, f"worker{self.rank}" if self.tp > 1 else "worker")
            self._layers: list[tuple[str, torch.Tensor, int]] = []  # name, kv tensor, rows/block
            self._stage: mmap.mmap | None = None
            self._stage_views: list[torch.Tensor] = []
            self._bad_blocks: set[int] = set()
            self._failed_reqs: set[str] = set()
            self._remove_stale_tmp()
        logger.info("KvtraceFileConnector (%s): %s, %d bytes per block, %d layers", role.name, self.dir,
                    self.block_bytes, len(self.layout["layers"]))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss

    def _path(self, hex_hash: str, rank: int | None = None) -> str:
        """A block's file (this worker's rank's shard with tensor parallelism: HASH.tpRANK)."""
        if self.tp == 1:
            return os.path.join(self.dir, hex_hash)
        return os.path.join(self.dir, f"{hex_hash}.tp{self.rank if rank is None else rank}")

    def _stored(self, hex_hash: str) -> bool:
        """Whether every rank's shard of a block is there, whole."""
        try:
            return all(os.stat(self._path(hex_hash, r)).st_size == self.block_bytes for r in range(self.tp))
        except FileNotFoundError:
            return False

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: "Request") -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request   # (vLLM before 0.21 has no on_new_request)
        if not self.do_load:
            return 0, False
        try:
            bs = self.block_size
            start = num_computed_tokens // bs
            # vLLM recomputes the last token, so the hit may cover at most num_tokens-1 tokens.
            limit = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
            n = 0
            for i in range(start, limit):
                if not self._stored(request.block_hashes[i].hex()):
                    break
                n += 1
            self._lookup[request.request_id] = start
            self.stats.add(lookups=1)
            return n * bs, False
        except Exception as e:
            self.stats.error("lookup_errors", e)
            return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        start = self._lookup[request.request_id]
        n = num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0][start:start + n]
        hashes = request.block_hashes[start:start + n]
        self._loads.append(BlockTransfer(request.request_id, [(b, h.hex()) for b, h in zip(block_ids, hashes)]))
        self.stats.add(planned_load_blocks=n)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = FileConnectorMetadata(loads=self._loads)
        self._loads = []
        if self.do_store:
            try:
                meta.stores = self._plan_stores(scheduler_output)
            except Exception as e:  # a store never planned is a later miss, nothing worse
                self.stats.error("store_plan_errors", e)
        self.stats.flush()
        return meta

    def _plan_stores(self, scheduler_output: "SchedulerOutput") -> list[BlockTransfer]:
        """Every block whose last token gets its KV in this step."""
        bs = self.block_size
        spec = scheduler_output.scheduled_spec_decode_tokens
        if self._tracked is not None:
            self._tracked.update(scheduler_output)
        stores = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self._requests.get(req_id)
            if req is None:
                continue
            # num_computed_tokens is still the value before this step; draft tokens may be
            # rejected, so only the verified part fills blocks.
            done = req.num_computed_tokens
            first = done // bs
            last = min((done + n - len(spec.get(req_id, ()))) // bs, len(req.block_hashes))
            if last <= first:
                continue
            ids = self._block_ids(scheduler_output, req_id)
            if not ids:
                continue
            ids = ids[0]
            last = min(last, len(ids))
            stores.append(BlockTransfer(req_id, [(ids[i], req.block_hashes[i].hex()) for i in range(first, last)]))
            self.stats.add(planned_store_blocks=last - first)
        return stores

    def _block_ids(self, so: "SchedulerOutput", req_id: str) -> tuple[list[int], ...] | None:
        if self._tracked is not None:
            return self._tracked.get(req_id)
        state = so.kv_connector_block_state
        ids = state.get_block_ids(req_id) if state is not None else None
        return ids if ids is not None else self._kv_cache_manager.get_block_ids(req_id)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._lookup.pop(request.request_id, None)
        if self._tracked is not None:
            self._tracked.drop(request.request_id)
        return False, None

    # ------------------------------------------------------------------ worker side

    def _remove_stale_tmp(self) -> None:
        """Temporary files left by a process that died mid-store (name: .<hash>.<pid>.tmp)."""
        try:
            for name in os.listdir(self.dir):
                if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
                    continue
                try:
                    pid = int(name.split(".")[-2])
                    os.kill(pid, 0)
                except ProcessLookupError:
                    os.unlink(os.path.join(self.dir, name))
                except (ValueError, IndexError, OSError):
                    pass
        except OSError as e:
            self.stats.error("tmp_cleanup_errors", e)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        layers = []
        offset = 0
        shapes = []
        for name in self.layout["layers"]:
            kv = kv_caches[name]
            rows = block_rows(kv, self.num_blocks)
            if rows is None:
                raise ValueError(f"{name}: KV tensor {tuple(kv.shape)} does not split into {self.num_blocks} blocks")
            piece = self._block(kv, rows, 0)
            nbytes = piece.numel() * piece.element_size()
            if nbytes != self.layout["layer_block_bytes"]:
                raise ValueError(f"{name}: a block slice holds {nbytes} bytes, layout says "
                                 f"{self.layout['layer_block_bytes']}")
            layers.append((name, kv, rows))
            shapes.append((offset, nbytes, kv.dtype, tuple(piece.shape)))
            offset += nbytes
        if self.direct and self.block_bytes % mmap.PAGESIZE:
            raise ValueError(f"direct_io needs a block of whole pages ({mmap.PAGESIZE} bytes); a block is {self.block_bytes}")
        self._stage = mmap.mmap(-1, self.block_bytes)   # page-aligned, as O_DIRECT reads need
        base = torch.frombuffer(self._stage, dtype=torch.uint8)
        self._stage_views = [base[o:o + nb].view(dt).view(shape) for o, nb, dt, shape in shapes]
        self._layers = layers
        logger.info("KvtraceFileConnector: %d KV layers, block slice %s %s (%s)", len(layers), shapes[0][3],
                    shapes[0][2], f"{layers[0][2]} rows per block" if layers[0][2] else "K and V outermost")

    @staticmethod
    def _block(kv: torch.Tensor, rows: int, block_id: int) -> torch.Tensor:
        """One block of one layer: ``rows`` rows of a block-outermost tensor, or (rows 0) the
        block's K and V of a (2, num_blocks, ...) tensor."""
        return kv[block_id * rows:(block_id + 1) * rows] if rows else kv[:, block_id]

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._failed_reqs = set()
        meta = self._connector_metadata
        if not isinstance(meta, FileConnectorMetadata) or not meta.loads:
            return
        for job in meta.loads:
            self._load(job)
        self.stats.flush()

    def _load(self, job: BlockTransfer) -> None:
        t0 = time.monotonic_ns()
        done = nbytes = 0
        failed_at = None
        for i, (block_id, hex_hash) in enumerate(job.blocks):
            try:
                self._read_block(block_id, hex_hash)
                done += 1
                nbytes += self.block_bytes
            except Exception as e:
                self.stats.error("load_errors", e)
                logger.warning("KvtraceFileConnector: block %s of %s not loaded (%s); vLLM recomputes it",
                               hex_hash[:16], job.req_id, e)
                failed_at = i
                break
        t1 = time.monotonic_ns()
        if failed_at is not None:
            # This and every later block of the request hold no valid KV: vLLM truncates the
            # request's computed tokens at the first of them and recomputes.
            self._bad_blocks.update(b for b, _ in job.blocks[failed_at:])
            self._failed_reqs.add(job.req_id)
        self.stats.add(load_requests=1, load_blocks=done, load_bytes=nbytes, load_ns=t1 - t0)
        _report("load", job.req_id, done, nbytes, t0, t1, self.stats)

    def _read_block(self, block_id: int, hex_hash: str) -> None:
        if self._stage is None:
            raise RuntimeError("KV caches not registered")
        path = self._path(hex_hash)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0))
        try:
            size = os.fstat(fd).st_size
            if size != self.block_bytes:
                self._discard(path)
                raise ValueError(f"file holds {size} bytes, a block is {self.block_bytes}")
            view = memoryview(self._stage)
            got = 0
            while got < self.block_bytes:
                n = os.preadv(fd, [view[got:]], got)
                if n <= 0:
                    self._discard(path)
                    raise ValueError(f"short read: {got} of {self.block_bytes} bytes")
                got += n
        finally:
            os.close(fd)
        for (_, kv, rows), src in zip(self._layers, self._stage_views):
            self._block(kv, rows, block_id).copy_(src)

    def _discard(self, path: str) -> None:
        """Remove a damaged block file so the recomputed block can be stored again."""
        try:
            os.unlink(path)
            self.stats.add(discarded_files=1)
        except OSError:
            pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete inside start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # whole blocks are stored in wait_for_save, once every layer is written

    def wait_for_save(self):
        try:
            meta = self._connector_metadata
            if not isinstance(meta, FileConnectorMetadata) or not meta.stores:
                return
            for job in meta.stores:
                if job.req_id in self._failed_reqs:
                    self.stats.add(store_skipped_failed_load=len(job.blocks))
                    continue
                self._store(job)
            self.stats.flush()
        except Exception as e:  # never raise into vLLM from the store path
            self.stats.error("store_errors", e)

    def _store(self, job: BlockTransfer) -> None:
        t0 = time.monotonic_ns()
        done = 0
        for block_id, hex_hash in job.blocks:
            path = self._path(hex_hash)
            if os.path.exists(path):
                self.stats.add(store_skipped_existing=1)
                continue
            try:
                self._write_block(block_id, path, hex_hash)
                done += 1
            except Exception as e:
                self.stats.error("store_errors", e)
        t1 = time.monotonic_ns()
        nbytes = done * self.block_bytes
        self.stats.add(store_blocks=done, store_bytes=nbytes, store_ns=t1 - t0)
        _report("store", job.req_id, done, nbytes, t0, t1, self.stats)

    def _write_block(self, block_id: int, path: str, hex_hash: str) -> None:
        if self._stage is None:
            raise RuntimeError("KV caches not registered")
        for (_, kv, rows), dst in zip(self._layers, self._stage_views):
            dst.copy_(self._block(kv, rows, block_id))
        tmp = os.path.join(self.dir, f".{hex_hash}.{os.getpid()}{TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(self._stage)
            put = 0
            while put < self.block_bytes:
                put += os.write(fd, view[put:])
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        os.close(fd)
        os.rename(tmp, path)
