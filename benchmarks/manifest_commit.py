"""Benchmark: what one block commit costs as a run grows, from 100 to 100,000 committed blocks.

Runs the product's own :class:`eagle3ray.blocks.Manifest` on synthetic entries (8 sample ids each, as a block of
8 conversations; no block files are needed to commit). For each size N it prints, side by side:

- ``rewrite``: one rewrite of the whole manifest (``Manifest.save``), which is what every commit cost before the
  commit log (the manifest was rewritten on each commit);
- ``commit median / mean``: ``--commits`` commits on top of N (one commit file each);
- ``amortized``: the mean plus the snapshot rewrites, which happen once the log is as long as the snapshot
  (``rewrite / max(COMPACT_MIN, N)`` per commit);
- ``open``: opening the manifest to resume (snapshot + commit log folded, all committed ids known; no block read).

Medians over ``--rounds`` rounds. ``--s3`` runs the same against a local S3 endpoint (moto, 127.0.0.1).

    .venv/bin/python benchmarks/manifest_commit.py --sizes 100,1000,10000,100000 --commits 200 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000,10000,100000")
    ap.add_argument("--commits", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--s3", action="store_true", help="a local S3 endpoint (moto) instead of a local folder")
    args = ap.parse_args()

    from eagle3ray import blocks, storage

    server = None
    if args.s3:
        import boto3
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        server.start()
        endpoint = f"http://127.0.0.1:{server._server.server_port}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="x", aws_secret_access_key="x",
                     region_name="us-east-1").create_bucket(Bucket="bench")
        import os

        os.environ.setdefault("AWS_ACCESS_KEY_ID", "x")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "x")
        uri, opts = "s3://bench/m", endpoint
    else:
        uri, opts = f"file://{tempfile.mkdtemp(prefix='e3r-manifest-')}", None

    def entry(i: int) -> dict:
        return {"path": f"blocks/part-{i:08d}.parquet", "rows": 8, "tokens": 4096, "bytes": 4096 * 4608,
                "sha256": f"{i:064x}", "sample_ids": [f"sharegpt:{i}-{j}" for j in range(8)]}

    print(f"storage {'local S3 endpoint (moto)' if args.s3 else 'local folder'}; {args.commits} commits per size, "
          f"medians over {args.rounds} rounds; COMPACT_MIN {blocks.COMPACT_MIN}", flush=True)
    print(f"{'blocks':>8} {'manifest':>10} {'rewrite':>10} {'commit med':>11} {'commit mean':>12} "
          f"{'amortized':>10} {'open':>9} {'rewrite/amortized':>18}")
    for r_n in map(int, args.sizes.split(",")):
        rows = []
        for rnd in range(args.rounds):
            fs, root = storage.filesystem(f"{uri}/n{r_n}-r{rnd}", opts)
            data = blocks.new_manifest({"config_hash": "c", "hidden_size": 4096, "num_hidden_layers": 32},
                                       [2, 16, 29, 32], "bfloat16", {"sha256": "s", "samples": r_n * 8})
            data["rejected"] = {"prepare": {}, "extract": {}}
            data["blocks"] = [entry(i) for i in range(r_n)]
            data["counts"].update(samples=8 * r_n, tokens=4096 * r_n, bytes=4096 * 4608 * r_n)
            man = blocks.Manifest(fs, root, data)
            t = time.perf_counter()
            man.save()  # the old per-commit cost: the whole manifest rewritten
            rewrite = time.perf_counter() - t
            size = fs.info(f"{root}/manifest.json")["size"]
            t = time.perf_counter()
            man = blocks.Manifest.open(fs, root, data, "bench")
            man.committed_ids()
            opened = time.perf_counter() - t
            times = []
            for k in range(args.commits):
                e = entry(r_n + k)
                t = time.perf_counter()
                man.commit(e, e["sample_ids"], {})
                times.append(time.perf_counter() - t)
            rows.append((size, rewrite, statistics.median(times), statistics.mean(times), opened))
        size, rewrite, med, mean, opened = (statistics.median(x) for x in zip(*rows))
        amort = mean + rewrite / max(blocks.COMPACT_MIN, r_n)
        print(f"{r_n:>8,} {size / 1e6:>8.2f}MB {rewrite * 1e3:>8.1f}ms {med * 1e3:>9.2f}ms {mean * 1e3:>10.2f}ms "
              f"{amort * 1e3:>8.2f}ms {opened * 1e3:>7.0f}ms {rewrite / amort:>17.1f}x", flush=True)
    if server is not None:
        server.stop()


if __name__ == "__main__":
    main()
