"""Tokenization throughput of the token cache (zoa_train/data/shards.py): one process against worker processes,
on the same corpus, in one run (docs/data.md, "Throughput").

    python scripts/bench_tokenize.py                      # the bundled corpus 8 times (32M characters), 1 vs 2 workers
    python scripts/bench_tokenize.py --copies 20 --workers 4 --rounds 3

The corpus is the bundled novels' paragraphs, each copy in another order, held in memory: the figure is the
build's (tokenize, gather the ids, write the shards), not reading text. Each round builds once with each
setting, alternately, into fresh directories; the best round of each is reported (other processes on the
machine only ever slow a round down), with the ratio, and the CPU time each took: where other processes hold
cores, the workers' ratio is bounded by the cores left (``cores_busy``), not by the build.
"""

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from zoa_train.data import TextSource, prepare_lm_data
from zoa_train.data.shards import available_cores, build_shards, document_separator, fast_backend
from zoa_train.data.sources import bundled_paragraphs


def _cpu_seconds() -> float:
    """User and system time of this process and of its children that have ended (the pool's workers, once joined)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=8, help="copies of the bundled corpus (4M characters each); default 8")
    parser.add_argument("--workers", type=int, default=available_cores(), help="worker processes to compare with one; default: the cores")
    parser.add_argument("--rounds", type=int, default=2, help="builds of each setting; default 2")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path("~/.cache/zoa-train").expanduser(), help="where the tokenizer is trained once; default ~/.cache/zoa-train"
    )
    args = parser.parse_args()
    tokenizer = prepare_lm_data(TextSource("bundled"), "gpt2", args.cache_dir, vocab_size=8192).tokenizer
    backend, separator = fast_backend(tokenizer), document_separator(tokenizer)
    paragraphs = bundled_paragraphs()
    rng = np.random.default_rng(0)
    texts = [paragraphs[i] for _ in range(args.copies) for i in rng.permutation(len(paragraphs))]
    best: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for workers in (1, args.workers):
                prefix = Path(tmp) / f"round{round_}-w{workers}" / "tokens"
                prefix.parent.mkdir()
                cpu, started = _cpu_seconds(), time.perf_counter()
                manifest = build_shards(iter(texts), backend, separator, np.uint16, prefix, workers, f"bench, {workers} worker(s)")
                seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
                result = {"workers": workers, "tokens": manifest["num_tokens"], "shards": len(manifest["shards"]), "seconds": round(seconds, 2)}
                # cores_busy: CPU time (this process and its workers) over wall time; below the workers' number where
                # other processes had the cores
                result |= {"tokens_per_s": round(manifest["num_tokens"] / seconds), "cpu_s": round(cpu, 2), "cores_busy": round(cpu / seconds, 2)}
                print(json.dumps(result), flush=True)
                if workers not in best or result["seconds"] < best[workers]["seconds"]:
                    best[workers] = result
    summary = {
        "characters": sum(map(len, texts)),
        "cores": available_cores(),
        "one_process_tokens_per_s": best[1]["tokens_per_s"],
        "workers": args.workers,
        "workers_tokens_per_s": best[args.workers]["tokens_per_s"],
        "speedup": round(best[args.workers]["tokens_per_s"] / best[1]["tokens_per_s"], 2),
        "cpu_s_ratio": round(best[args.workers]["cpu_s"] / best[1]["cpu_s"], 2),  # the workers' overhead in CPU time
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
