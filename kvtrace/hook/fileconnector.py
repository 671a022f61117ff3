"""kvtrace's file KV connector under its earlier name, kept for one release: kvtrace 0.2.0
removes it.  Its place is kvtrace.hook.vllm.fileconnector; a ``--kv-transfer-config`` whose
``kv_connector_module_path`` still names ``kvtrace.hook.fileconnector`` loads the same
connector from here.  Imports vLLM and torch, as the connector does.
"""
from __future__ import annotations

from .vllm.fileconnector import (BlockTransfer, FileConnectorMetadata, KvtraceFileConnector, block_layout)

__all__ = ["BlockTransfer", "FileConnectorMetadata", "KvtraceFileConnector", "block_layout"]
