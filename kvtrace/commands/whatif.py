"""`kvtrace whatif DIR`: replay the recorded requests under other chunk and cache settings."""
from __future__ import annotations

import click


def _ints(minimum: int = 1):
    """A click callback: a comma-separated list of whole numbers, each at least ``minimum``
    (0, negatives, nan, fractions and empty items are refused with the option's name)."""

    def parse(ctx, param, s: str | None) -> list[int] | None:
        if s is None:
            return None
        out = []
        for part in s.split(","):
            part = part.strip()
            try:
                v = int(part)
            except ValueError:
                raise click.BadParameter(f"{part!r} is not a whole number (give e.g. 256,512)") from None
            if v < minimum:
                raise click.BadParameter(f"{v} is too small: give whole numbers of at least {minimum}")
            out.append(v)
        return out

    return parse


@click.command("whatif")
@click.argument("directory", type=click.Path())
@click.option("--chunk-size", callback=_ints(), help="Chunk budget(s), tokens per step (vLLM --max-num-batched-tokens), comma-separated. Default: as recorded.")
@click.option("--block-size", callback=_ints(), help="Tokens per KV block, comma-separated; multiples of the recorded block size. Default: as recorded.")
@click.option("--cache-blocks", callback=_ints(2),
              help="KV cache size(s) in blocks (vLLM --num-gpu-blocks-override: the null block included, so at least 2), "
                   "comma-separated; a size whose replay would take more than half of MemAvailable is refused.")
@click.option("--storage-tier", default=None,
              help="Comma-separated: none, file[:BLOCKS][@READ_GBPS[/LATENCY_US]] (a KV connector that stores every "
                   "computed block and loads a prefix back at admission; BLOCKS, a whole number above 0, bounds it, LRU; "
                   "READ_GBPS and LATENCY_US, its read speed and latency per block, else the recorded ones), or "
                   "lmcache[:L1_GB][@L2_READ_GBPS[/LATENCY_US]] (LMCache's whole chunks in an L1 of L1_GB GiB over an "
                   "L2 on disk read at L2_READ_GBPS; else the recorded L1 size and read speed). Default: as recorded.")
@click.option("--max-num-seqs", type=click.IntRange(1), default=256, show_default=True, help="Running requests at most (vLLM --max-num-seqs).")
@click.option("--max-combinations", type=click.IntRange(1), default=500, show_default=True,  # whatif.MAX_COMBINATIONS
              help="Refuse (exit 2) a grid of more combinations than this; each replays every recorded request "
                   "(the grid's size and an estimate of its time are said on stderr before the sweep).")
@click.option("--router", "router", default=None, metavar="POLICY,..",
              help="A fleet's dataset (several engines: attach --port A --port B): send its requests through these "
                   "routing policies instead (round_robin, least_loaded, cache_aware[:THRESHOLD]), each replica's "
                   "cache at the recorded settings; predicts hit rate and balance per policy.")
@click.option("--json", "as_json", is_flag=True, help="Print the predictions as JSON.")
@click.option("--wide", is_flag=True, help="Show every column, however wide the lines get.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None,
              help="Also write an HTML page: heat maps of TTFT p50 and hit rate over chunk size and storage tier.")
def command(directory, chunk_size, block_size, cache_blocks, storage_tier, max_num_seqs, max_combinations, router,
            as_json, wide, html_path) -> int:
    """Predict hit rate, recomputed tokens, evictions, storage loads and wait, TTFT and throughput
    for other settings; every combination of the comma-separated values is replayed."""
    import json

    from kvtrace.analysis import whatif  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    if router:
        return _router(directory, router, chunk_size or block_size or cache_blocks or storage_tier or html_path,
                       max_num_seqs, as_json)
    tiers = [t.strip() for t in storage_tier.split(",")] if storage_tier else None
    res = whatif.run(directory, chunk_sizes=chunk_size, block_sizes=block_size,
                     cache_blocks=cache_blocks, tiers=tiers, max_num_seqs=max_num_seqs,
                     max_combinations=max_combinations, say=lambda line: click.echo(f"kvtrace: {line}", err=True))
    if html_path:
        from kvtrace.analysis.whatif import html  # lazy: only --html needs it
        from kvtrace.dataset.writer import write_text  # lazy: as above

        write_text(html_path, html.to_html(res))
    if as_json:
        click.echo(json.dumps(res, indent=1))
    else:
        whatif.print_table(res, wide=wide)
    return 0


def _router(directory, policies: str, other, max_num_seqs: int, as_json: bool) -> int:
    """whatif --router: each routing policy's prediction beside the recorded routing."""
    import json

    from kvtrace.analysis.whatif import router  # lazy: start-up cost: the CLI imports every command's module (cli._register)
    from kvtrace.errors import UsageError  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    if other:
        raise UsageError("--router replays the recorded settings: give it without --chunk-size, --block-size, "
                         "--cache-blocks, --storage-tier and --html")
    specs = [p.strip() for p in policies.split(",") if p.strip()]
    for spec in specs:
        router.parse(spec)   # a policy kvtrace does not model: exit 2 before the dataset is read
    res = router.run(directory, specs, max_num_seqs)
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return 0
    click.echo(f"whatif --router: {res['requests']} requests of {res['dataset']} over {res['replicas']} replicas, "
               "each at the recorded settings")
    click.echo(f"{'policy':<20} {'hit rate':>9} {'hit tokens':>11} {'evictions':>9}  requests per replica")
    for p in res["predictions"]:
        rate = "-" if p["hit_rate"] is None else f"{100 * p['hit_rate']:.2f}%"
        click.echo(f"{p['policy']:<20} {rate:>9} {p['hit_tokens']:>11,} {p['evictions']:>9,}  "
                   f"{' / '.join(map(str, p['requests_per_replica']))}")
    return 0
