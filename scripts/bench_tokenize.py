"""First tokenisation of a large data file: wall time and peak memory of filling the token cache.

--kind text: a .txt file (one document), the bundled plays repeated to --mb MB. --kind chat: a JSONL file of the
bundled chat conversations repeated to --mb MB, built as `type: chat` with the chatml template (seq_len 512). Each
case tokenises into an empty token cache in a fresh process, with the memtrain found at --code (default: this
checkout; another checkout or worktree gives the before of a change), and writes one row to benchmarks/tokenize.csv
with its Markdown view. peak_rss_gib is the largest of the processes' peaks (Linux's RUSAGE_CHILDREN), so with
worker processes it is one process's, not their sum.

    python -m scripts.bench_tokenize --mb 100
    python -m scripts.bench_tokenize --kind chat --mb 40 --code ../before --label "before the change"
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.bench_common import ROOT, machine_name, upsert_row

COLUMNS = ["case", "file_mb", "tokens", "seconds", "peak_rss_gib", "code", "machine", "date", "command"]
CHILD = """
import json, sys, time
from memtrain.data.tokens.cache import cached_tokens
from memtrain.data.rows.dataset import build_datasets
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.recipe.schema import Data, Model
path, cache, kind = sys.argv[1:]
tokenizer = load_tokenizer(Model(preset="tiny", tokenizer="builtin:shakespeare" + ("-chat" if kind == "chat" else "")))
started = time.perf_counter()
if kind == "text":
    tokens = len(cached_tokens(path, "auto", "text", tokenizer, cache))
else:
    data = Data(train=[{"path": path, "type": "chat"}], template="chatml", seq_len=512, cache_dir=cache)
    train, validation = build_datasets(data, tokenizer, seed=0)
    tokens = train.stats.tokens + validation.stats.tokens
print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - started}))
"""


def make_text(path: Path, megabytes: int) -> Path:
    """`megabytes` MB of the bundled plays, repeated: one document."""
    if path.exists() and path.stat().st_size >= megabytes << 20:
        return path
    plays = gzip.decompress((ROOT / "memtrain/assets/corpus/shakespeare/train.txt.gz").read_bytes())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        for _ in range(-(-(megabytes << 20) // len(plays))):
            handle.write(plays)
    return path


def make_chat(path: Path, megabytes: int) -> Path:
    """`megabytes` MB of the bundled chat conversations (JSONL), repeated."""
    if path.exists() and path.stat().st_size >= megabytes << 20:
        return path
    block = (ROOT / "memtrain/assets/chat/train.jsonl").read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        for _ in range(-(-(megabytes << 20) // len(block))):
            handle.write(block)
    return path


def commit_of(code: Path) -> str:
    done = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or str(code)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("text", "chat"), default="text")
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--code", type=Path, default=ROOT, help="checkout whose memtrain tokenises")
    parser.add_argument("--label", default="", help="added to the case's name: what the checkout holds")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/memtrain-tokenize"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "tokenize.csv")
    args = parser.parse_args()
    text = (
        make_text(args.runs / f"plays-{args.mb}mb.txt", args.mb)
        if args.kind == "text"
        else make_chat(args.runs / f"chat-{args.mb}mb.jsonl", args.mb)
    )
    cache = Path(tempfile.mkdtemp(dir=args.runs, prefix="tokens-"))
    env = {**os.environ, "PYTHONPATH": str(args.code.resolve())}
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(text), str(cache), args.kind],
            env=env,
            cwd=args.code,
            capture_output=True,
            text=True,
        )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return 1
    result = json.loads(done.stdout.strip().splitlines()[-1])
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1024**3  # Linux: KiB
    code = commit_of(args.code)
    command = (
        "python -m scripts.bench_tokenize"
        + (" --kind chat" if args.kind == "chat" else "")
        + f" --mb {args.mb}"
        + (f" --code {args.code}" if args.code != ROOT else "")
        + (f" --label '{args.label}'" if args.label else "")
    )
    what = f"{args.mb} MB " + (".txt" if args.kind == "text" else "chat JSONL")
    row = {
        "case": f"{what} ({args.label}, {code})" if args.label else f"{what} ({code})",
        "file_mb": str(round(text.stat().st_size / 2**20)),
        "tokens": str(result["tokens"]),
        "seconds": f"{result['seconds']:.1f}",
        "peak_rss_gib": f"{peak_gib:.2f}",
        "code": code,
        "machine": machine_name(),
        "date": dt.date.today().isoformat(),
        "command": command,
    }
    print(json.dumps(row), flush=True)
    upsert_row(
        args.out,
        row,
        COLUMNS,
        "First tokenisation of one large text file: time and peak memory",
        keys=("case", "machine"),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
