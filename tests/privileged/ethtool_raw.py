"""``ethtool -S IFACE`` through the raw SIOCETHTOOL ioctl, written independently of pyroute2
(an independent reader of the kernel's own numbers for the tests).  Prints JSON."""
from __future__ import annotations

import ctypes
import fcntl
import json
import socket
import struct
import sys

SIOCETHTOOL = 0x8946
ETHTOOL_GSSET_INFO, ETHTOOL_GSTRINGS, ETHTOOL_GSTATS = 0x37, 0x1B, 0x1D
ETH_SS_STATS = 1


def ioctl(sock, ifname: str, buf) -> None:
    ifreq = struct.pack("16sP", ifname.encode(), ctypes.addressof(buf))
    fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)


def stats(ifname: str) -> dict[str, int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    info = ctypes.create_string_buffer(struct.pack("IIQI", ETHTOOL_GSSET_INFO, 0, 1 << ETH_SS_STATS, 0))
    ioctl(s, ifname, info)
    n = struct.unpack_from("I", info.raw, 16)[0]
    strings = ctypes.create_string_buffer(struct.pack("III", ETHTOOL_GSTRINGS, ETH_SS_STATS, n) + bytes(32 * n))
    ioctl(s, ifname, strings)
    names = [strings.raw[12 + 32 * i: 12 + 32 * (i + 1)].split(b"\0", 1)[0].decode() for i in range(n)]
    values = ctypes.create_string_buffer(struct.pack("II", ETHTOOL_GSTATS, n) + bytes(8 * n))
    ioctl(s, ifname, values)
    return dict(zip(names, struct.unpack_from(f"{n}Q", values.raw, 8)))


if __name__ == "__main__":
    print(json.dumps(stats(sys.argv[1])))
