"""One module per `kvtrace` subcommand; each exposes ``command`` (a click command)."""
