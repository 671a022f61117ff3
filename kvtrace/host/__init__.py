"""What this host offers: privileges, tracefs, BTF, headers, tracepoint families (no bcc import)."""
