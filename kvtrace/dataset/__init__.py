"""The Parquet dataset: one table per event kind, partitioned by host and date."""
