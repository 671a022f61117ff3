"""The storage fabric under the KV tier: NVMe(-oF) topology from sysfs, tracepoint formats,
NIC and RDMA counter pollers, and the kernel-map readers for the nvme/tcp/rdma probes.

Nothing here imports bcc: the BPF side lives in probes/ and kvtrace/capture/.
"""
