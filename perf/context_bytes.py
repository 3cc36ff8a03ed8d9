"""A round's bytes against the pool's ``max_context``, at a fixed request length: the
paged pools read what the requests' positions reach, and the page table's gathers (the
``page_table`` label: ``[T, max_context / page_size]`` int32 per forward) are all that
grows with the context a pool is sized for.

Counted on the meta device with the work profile (``nextn-graph profile``): the full
DeepSeek-V4-Flash round at bucket B, every request at ``--context-len`` positions, for
each ``--max-context``. A count of bytes each op touches, not a device measurement.

    python perf/context_bytes.py [--bucket 1] [--context-len 4096]
                                 [--max-context 8192 65536 262144]
"""

from __future__ import annotations

import argparse

from nextn_graph.checkpoint.presets import preset_config
from nextn_graph.profile.build import ProfileSettings
from nextn_graph.profile.run import profile_round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket", type=int, default=1)
    ap.add_argument("--context-len", type=int, default=4096)
    ap.add_argument("--max-context", type=int, nargs="+", default=[8192, 65536, 262144])
    args = ap.parse_args()
    cfg = preset_config("v4-flash")
    rows = []
    for mc in args.max_context:
        st = ProfileSettings(bucket=args.bucket, max_context=mc, context_len=args.context_len,
                             max_requests=max(args.bucket, 1))
        rep = profile_round(cfg, st, "preset v4-flash")
        mods = rep["modules"]
        rows.append((mc, rep["bytes_per_round"], mods.get("kv_cache", {}).get("bytes_per_round", 0),
                     mods.get("page_table", {}).get("bytes_per_round", 0),
                     mods.get("page_table", {}).get("kernels_per_round", 0)))
    base = rows[0][1]
    print(f"V4-Flash round, B={args.bucket}, every request at {args.context_len} positions "
          f"(meta-device count, bf16, auto kernels on h200)")
    print("| max_context | bytes per round | vs first | kv_cache bytes | page_table bytes "
          "| page_table kernels |")
    print("|---|---|---|---|---|---|")
    for mc, total, kv, table, kernels in rows:
        print(f"| {mc} | {total:,} | {total / base:.7f}x (+{total - base:,}) | {kv:,} | "
              f"{table:,} | {kernels} |")


if __name__ == "__main__":
    main()
