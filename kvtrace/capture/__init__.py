"""Capture: BPF probes (probes/<name>.bpf.c) each paired with a decoder module of the same name.

Decoders import no bcc: they turn recorded event bytes into Arrow tables, so they are tested
on recorded bytes without root. Only kvtrace.capture.loader imports bcc.
"""
from kvtrace.capture import blockio, fdopen, filemap, fileio, iouring, nvme, proc, rdma, tcp, ulib, usermark

# Order matters for the program text: proc first (it maintains the target set), usermark
# before fileio (fileio's sys_enter_write hands marker writes to it), blockio before nvme
# (nvme looks submitters up in blockio's map).
PROBES = (proc, usermark, blockio, fileio, fdopen, filemap, iouring, nvme, tcp, rdma, ulib)
BY_KIND = {p.KIND: p for p in PROBES}
BY_NAME = {p.NAME: p for p in PROBES}
