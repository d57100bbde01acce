"""Load test of `sparsespec serve`: N concurrent streaming clients on loopback, the metrics `vllm bench serve`
reports (requests/s, output tokens/s, time to first token and inter-token latency p50/p99), and a check that every
greedy answer equals the one its prompt gets alone.

    # start a server per --max-batch value (continuous batching against one request at a time), 64 clients:
    python bench/serve_load.py --model smollm2-135m --max-batch 16,1 --clients 64 --max-tokens 32
    # GPU (real weights; `serve` loads packaged or local models, not random ones):
    python bench/serve_load.py --model qwen2.5-coder-1.5b --device cuda --max-batch 64,1 --clients 1,16,64 \\
        --max-tokens 128 --ignore-eos --max-context 2048 --out docs/results/serve-gpu
    # or an already running server:
    python bench/serve_load.py --url http://127.0.0.1:8000 --model smollm2-135m --clients 16

Each client sends its requests one after another (`--requests` per run, default the largest --clients); the prompts are
real text of varied lengths (the wiki corpus). A request counts as failed on any error or an empty answer. "alone":
each prompt is first sent on its own (one client, nothing else running), and every answer of the load runs is
compared with that one (greedy, so they must be equal token for token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparsespec import corpora  # noqa: E402
from sparsespec.errors import SparseSpecError  # noqa: E402

console = Console(stderr=True)


@dataclass
class Result:
    prompt: int
    text: str = ""
    completion_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between successive streamed pieces
    error: str | None = None


@dataclass
class Row:
    max_batch: int | str
    clients: int
    requests: int
    failed: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    equal_alone: str  # "64/64"


def prompts(count: int, seed: int) -> list[str]:
    """`count` real-text prompts of 20 to 200 words."""
    return [corpora.text("wiki", 20 + (37 * i) % 181, seed=seed + i) for i in range(count)]


async def one(client: openai.AsyncOpenAI, model: str, prompt: str, index: int, args, on_token) -> Result:
    result = Result(index)
    start = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True} if args.ignore_eos else None)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                result.text += chunk.choices[0].text
                on_token()
            if chunk.usage is not None:
                result.completion_tokens = chunk.usage.completion_tokens
        if not result.completion_tokens:
            result.error = "no tokens"
    except openai.OpenAIError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def load(url: str, model: str, texts: list[str], clients: int, args, label: str) -> tuple[list[Result], float]:
    """`clients` concurrent clients working through every prompt (each client takes the next one when done)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(texts)):
        queue.put_nowait(i)
    results: list[Result] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[rate]}"), console=console, transient=True) as progress:
        task = progress.add_task(label, total=len(texts), rate="")
        tokens = 0
        start = time.perf_counter()

        def on_token():
            nonlocal tokens
            tokens += 1
            progress.update(task, rate=f"{tokens / (time.perf_counter() - start):.0f} pieces/s")

        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                      timeout=args.timeout) as client:
            async def worker():
                while not queue.empty():
                    i = queue.get_nowait()
                    results.append(await one(client, model, texts[i], i, args, on_token))
                    progress.advance(task)

            await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    return sorted(results, key=lambda r: r.prompt), wall


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)


def summarise(max_batch, clients: int, results: list[Result], wall: float, alone: list[Result] | None) -> Row:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    equal = "-" if alone is None else (f"{sum(r.error is None and r.text == alone[r.prompt].text for r in results)}"
                                       f"/{len(results)}")
    return Row(max_batch, clients, len(results), len(results) - len(ok), round(wall, 2),
               round(len(ok) / wall, 3), round(sum(r.completion_tokens for r in ok) / wall, 1),
               round(percentile(ttft, 50) * 1e3, 1), round(percentile(ttft, 99) * 1e3, 1),
               round(percentile(itl, 50) * 1e3, 1), round(percentile(itl, 99) * 1e3, 1), equal)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


class ServerProcess:
    """`sparsespec serve` in a child process, stopped with SIGTERM."""

    def __init__(self, args, max_batch: int, log: Path):
        self.url = f"http://127.0.0.1:{_free_port()}"
        cmd = [sys.executable, "-m", "sparsespec", "serve", "--model", args.model, "--device", args.device,
               "--port", self.url.rsplit(":", 1)[1], "--max-batch", str(max_batch),
               "--max-queue", str(max(args.clients) + args.requests_total), "--prefill-chunk",
               str(args.prefill_chunk)]
        for flag in ("dtype", "max_context"):
            if getattr(args, flag) is not None:
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        cmd += shlex.split(args.serve_args)
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.monotonic() + args.start_timeout
        with console.status(f"starting the server (max batch {max_batch}; log {log})"):
            while not _healthy(self.url):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    sys.exit(f"the server did not start; its log:\n{log.read_text()}")
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)
        self.log.close()


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",")]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="an already running server (else one is started per --max-batch)")
    p.add_argument("--model", default="smollm2-135m", help="model to serve (and the name requests use)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-batch", type=_ints, default=[16], help="servers to start, e.g. 16,1 (1: one request at "
                   "a time)")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--serve-args", default="", help="more `sparsespec serve` options for the started servers, e.g. "
                   "\"--draft ngram --block-size 8\" or \"--attention binarypc:budget=0.02\"")
    p.add_argument("--clients", type=_ints, default=[64], help="concurrent clients, e.g. 1,16,64")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default: the most clients)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ignore-eos", action="store_true", help="every request generates --max-tokens tokens")
    p.add_argument("--no-alone", action="store_true", help="skip the check against each prompt sent alone")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out", default=None, help="folder for serve_load.json and serve_load.md")
    args = p.parse_args()
    args.requests_total = args.requests or max(args.clients)
    try:
        texts = prompts(args.requests_total, args.seed)
    except SparseSpecError as e:  # e.g. the wiki corpus package is not installed
        sys.exit(f"error: {e}")
    out = Path(args.out) if args.out else None
    Path("build").mkdir(exist_ok=True)  # the servers' logs
    if out:
        out.mkdir(parents=True, exist_ok=True)

    rows: list[Row] = []
    alone: list[Result] | None = None
    for max_batch in ([None] if args.url else args.max_batch):
        server = None if args.url else ServerProcess(args, max_batch, Path("build").resolve() /
                                                     f"serve_b{max_batch}.log")
        url = args.url or server.url
        try:
            if alone is None and not args.no_alone:  # each prompt on its own (one client), once: the reference
                alone = asyncio.run(load(url, args.model, texts, 1, args, "each prompt alone"))[0]
                failed = [r for r in alone if r.error]
                if failed:
                    sys.exit(f"a prompt alone failed: {failed[0].error}")
            for clients in args.clients:
                results, wall = asyncio.run(load(url, args.model, texts, clients, args,
                                                 f"max batch {max_batch or '?'}, {clients} clients"))
                rows.append(row := summarise(max_batch or "?", clients, results, wall, alone))
                console.print(f"max batch {row.max_batch}, {clients} clients: {row.output_tokens_per_s} output "
                              f"tokens/s, {row.failed} failed, equal to alone {row.equal_alone}")
        finally:
            if server:
                server.stop()

    eos = " (EOS ignored)" if args.ignore_eos else ""
    table = Table(title=f"{args.model} on {args.device}, {args.max_tokens} new tokens{eos}, greedy")
    for name in Row.__dataclass_fields__:
        table.add_column(name.replace("_", " "), justify="right")
    for row in rows:
        table.add_row(*(str(v) for v in asdict(row).values()))
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    if out:
        machine = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
                   "host": f"{platform.machine()}, {os.cpu_count()} CPUs"}
        (out / "serve_load.json").write_text(json.dumps({"args": vars(args), "machine": machine,
                                                         "rows": [asdict(r) for r in rows]}, indent=1))
        header = list(Row.__dataclass_fields__)
        md = ["| " + " | ".join(h.replace("_", " ") for h in header) + " |", "|" + "---:|" * len(header)]
        md += ["| " + " | ".join(str(v) for v in asdict(r).values()) + " |" for r in rows]
        (out / "serve_load.md").write_text("\n".join(md) + "\n")
    if any(r.failed for r in rows) or any(r.equal_alone not in ("-", f"{r.requests}/{r.requests}") for r in rows):
        sys.exit("failed requests, or answers that differ from the prompt alone")


if __name__ == "__main__":
    main()
