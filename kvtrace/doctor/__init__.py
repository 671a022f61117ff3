"""`kvtrace doctor`'s checks of a host: privileges, kernel features, headers, bcc, tracepoint families, the storage fabric."""
