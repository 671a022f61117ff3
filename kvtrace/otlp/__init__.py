"""OTLP export: the span model, a wire encoder, a batching exporter (gRPC and HTTP/protobuf),
metrics, the live pipeline sink and the replay of a recorded dataset (docs/otlp.md)."""
