"""The BPF C sources of kvtrace's probes, shipped as package data (``kvtrace.bpf``).

Each ``<name>.bpf.c`` pairs with the Python decoder ``kvtrace/capture/<name>.py``;
``kvtrace.h`` holds the event header and maps every probe shares.
"""
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent


def source(name: str) -> str:
    """The text of ``<name>`` (e.g. ``"blockio.bpf.c"``)."""
    return (SOURCE_DIR / name).read_text()
