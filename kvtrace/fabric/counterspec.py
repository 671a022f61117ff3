"""NIC and RDMA counter specs: each counter's width, unit and scale (the tables and rules are
in kvtrace.fabric.counters' docstring), the scalar delta rule ``step()``, and ``Batch``: one
source's reads of one poll.  Shared by the readers (kvtrace.fabric.rdma, kvtrace.fabric.netdev)
and the delta state (kvtrace.fabric.deltas)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

U32, U64 = 1 << 32, 1 << 64


@dataclass(frozen=True)
class Spec:
    width: int = 64            # bits; 0 = unknown (32-bit wrap inferred when plausible)
    scale: int = 1             # raw -> value multiplier (4 for 4-byte words)
    unit: str = "events"
    saturating: bool = False   # stops at all ones instead of wrapping (IB PMA counters)
    wraps: bool = False        # a decrease is a wrap at ``width`` (not a reset)


# ib core PMA counters (ports/N/counters): (width of the basic set, unit)
PMA = {
    "symbol_error": (16, "events"), "link_error_recovery": (8, "events"), "link_downed": (8, "events"),
    "port_rcv_errors": (16, "packets"), "port_rcv_remote_physical_errors": (16, "packets"),
    "port_rcv_switch_relay_errors": (16, "packets"), "port_xmit_discards": (16, "packets"),
    "port_xmit_constraint_errors": (8, "packets"), "port_rcv_constraint_errors": (8, "packets"),
    "local_link_integrity_errors": (4, "events"), "excessive_buffer_overrun_errors": (4, "events"),
    "VL15_dropped": (16, "packets"), "port_xmit_wait": (32, "ticks"),
    "port_xmit_data": (32, "bytes"), "port_rcv_data": (32, "bytes"),
    "port_xmit_packets": (32, "packets"), "port_rcv_packets": (32, "packets"),
    "unicast_xmit_packets": (64, "packets"), "unicast_rcv_packets": (64, "packets"),
    "multicast_xmit_packets": (64, "packets"), "multicast_rcv_packets": (64, "packets"),
}
PMA_EXT = {"port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets"}
WORDS = {"port_xmit_data", "port_rcv_data"}   # 4-byte words
# mlx5 Q counters: 32-bit, wrap (be32 from QUERY_Q_COUNTER)
MLX5_Q32 = {
    "rx_write_requests", "rx_read_requests", "rx_atomic_requests", "rx_dct_connect", "out_of_buffer",
    "out_of_sequence", "duplicate_request", "rnr_nak_retry_err", "packet_seq_err", "implied_nak_seq_err",
    "local_ack_timeout_err", "resp_local_length_error", "resp_cqe_error", "req_cqe_error",
    "req_remote_invalid_request", "req_remote_access_errors", "resp_remote_access_errors",
    "resp_cqe_flush_error", "req_cqe_flush_error", "req_transport_retries_exceeded", "req_rnr_retries_exceeded",
    "roce_adp_retrans", "roce_adp_retrans_to", "roce_slow_restart", "roce_slow_restart_cnps",
    "roce_slow_restart_trans",
}
HW_BYTES = {"rdma_tx_bytes", "rdma_rx_bytes"}
HW_PACKETS = {"sent_pkts", "rcvd_pkts", "rdma_tx_packets", "rdma_rx_packets", "np_ecn_marked_roce_packets",
              "cc_rx_ce_pkts", "cc_rx_cnp_pkts", "cc_tx_cnp_pkts", "rx_icrc_encapsulated"}
HW_SKIP = {"lifespan"}   # a setting, not a counter


def pma_spec(name: str, ext: bool) -> Spec:
    width, unit = PMA.get(name, (0, "events"))
    if name in PMA_EXT:
        # 64-bit with the extended set; without unicast_* it is the basic set (32-bit,
        # saturating) or the extended set without IETF counters (64-bit): width unknown
        width = 64 if ext else 0
    return Spec(width=width, scale=4 if name in WORDS else 1, unit=unit, saturating=0 < width < 64)


def hw_spec(name: str, driver: str) -> Spec:
    unit = "bytes" if name in HW_BYTES else "packets" if name in HW_PACKETS else "events"
    if name.startswith("vport_") and name[6:] in MLX5_Q32:
        name = name[6:]
    if driver == "mlx5" and name in MLX5_Q32:
        return Spec(width=32, unit=unit, wraps=True)
    if driver in ("mlx5", "rxe", "siw"):
        return Spec(width=64, unit=unit)
    return Spec(width=0, unit=unit)


def step(prev: int | None, cur: int | None, spec: Spec) -> tuple[int | None, str]:
    """(raw delta or None, status) from the previous good raw value to this read."""
    if cur is None or (0 < spec.width < 64 and cur >> spec.width):
        return None, "garbage"   # unreadable, or more bits than the counter has
    if prev is None:
        return None, "first"
    if cur >= prev:
        if spec.saturating and cur == (1 << spec.width) - 1:
            return cur - prev, "saturated"
        return cur - prev, "ok"
    if spec.saturating:
        return None, "reset"
    if spec.wraps and spec.width < 64:
        return cur + (1 << spec.width) - prev, "wrap"
    if spec.width == 0 and prev < U32 and cur + U32 - prev <= U32 // 2:
        return cur + U32 - prev, "wrap"
    return None, "reset"


def parse_value(data: bytes | str | None) -> int | None:
    """A counter file's content to an unsigned integer, None when it is not one."""
    if data is None:
        return None
    if isinstance(data, bytes):
        data = data.decode("ascii", "replace")
    text = data.strip()
    if not text or not text.isdigit():
        return None
    v = int(text)
    return v if v < U64 else None


@dataclass
class Batch:
    """One source's reads of one poll, aligned with ``keys`` (source, device, port, name).

    ``keys``/``specs``/``netdevs`` stay the same objects from poll to poll until the source
    rediscovers its counters, so the delta state is realigned only then."""

    keys: list[tuple]
    specs: list[Spec]
    netdevs: list[str]
    vals: np.ndarray           # uint64 raw values
    ok: np.ndarray             # bool: the read gave a number
    errors: dict[int, str]     # index -> why not (garbage text, OS error)
    group: tuple = ()          # whose counters these are (delta state is kept per group)
    failed: list[tuple] = None  # (source, device, why): a whole device/interface unreadable


def make_batch(source: str, device: str, items, netdev: str = "", group: tuple = ()) -> Batch:
    """A batch from (name, value, Spec) items (ethtool, link): value None = unreadable."""
    keys, specs, vals, ok, errors = [], [], [], [], {}
    for i, (name, value, spec) in enumerate(items):
        keys.append((source, device, 0, name))
        specs.append(spec)
        good = isinstance(value, int) and 0 <= value < U64
        vals.append(value if good else 0)
        ok.append(good)
        if not good:
            errors[i] = "garbage"
    return Batch(keys, specs, [netdev] * len(keys), np.array(vals, dtype=np.uint64), np.array(ok, dtype=bool), errors,
                 group or (source, device))
