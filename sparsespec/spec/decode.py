"""The speculative decoding loop: draft up to B − 1 tokens per row, verify them in one target forward, commit, roll
back — for a batch of rows of any lengths.

    runner.prefill_tapped(prompts) -> features of the tapped layers -> drafter.start; sample t0 per row
    loop: proposals = drafter.propose(histories)                (each history ends with its pending token)
          logits [B, w, V] = runner.verify(blocks)             (row r's [pending, *proposals] at its length;
                                                                one forward, a graph of block_size slots on CUDA)
          committed = verify(proposals[r], logits[r])          (per row: accepted prefix + one target token)
          runner.truncate(n_r + accepted_r + 1)                (the rollback is "don't advance", row by row)
          drafter.commit(lengths, accepted, features of the newly cached tokens)

The target's cache slots past a row's committed length hold rejected drafts or padding: dead, rewritten by the
next step. Output stops exactly where plain decoding would (max new tokens, EOS, stop strings), so greedy output is
identical; each row draws from its own generator as it would alone.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..attention.policy import device_ints
from ..errors import SparseSpecError, whole
from ..generate import Engine, GenerationConfig
from ..runner import Runner, RunnerPool, loop_capacity
from ..sampling import SamplingConfig, make_generator, sample
from .drafters import Drafter
from .tree import MAX_NODES, Pool, TreeVerify, path
from .verify import verify_greedy_rows, verify_sampling, verify_sampling_rows


@dataclass
class SpecGeneration:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    committed: list[int] = field(default_factory=list)  # tokens committed per verify step (accepted + 1)
    copied: list[bool] = field(default_factory=list)  # per verify step: it checked a prompt lookup's copy (a
    #                                                  drafter of two sources, `--draft ngram+...`; else empty)
    setup_s: float = 0.0  # the call's time before decoding other than the first token's: the runner, the verify
    #                       and tree graphs' captures (and compilations); the drafter's start, its own captures
    #                       included, counts in ttft_s; the batch's, as ttft_s and decode_s

    @property
    def steps(self) -> int:
        return len(self.committed)

    @property
    def tau(self) -> float:
        """Mean tokens per verify step, the bonus included (1 = no proposal ever accepted)."""
        return sum(self.committed) / len(self.committed) if self.committed else float("nan")

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.committed).items()))


@torch.inference_mode()
def speculative_generate(engine: Engine, prompts: list[list[int]], drafter: Drafter, gen: GenerationConfig,
                         block_size: int = 16, runners: RunnerPool | None = None) -> list[SpecGeneration]:
    """Generate for a batch of prompts (token ids, any lengths) with `drafter` proposing up to block_size − 1 tokens
    per row and step. Each row keeps its own length (rows accept different numbers of proposals and roll back
    independently), its own random generator (seeded as a row alone), and its own proposal count (the one it
    would have alone), so each row's output is the one it gets alone; a stopped row is parked at slot 0 and rides
    along until every row has stopped. `runners`: a dense target's runner (and its captured verify steps) comes
    from this pool, for loops of many calls. A drafter with `tree_nodes` (DFlash: `--draft treeN:dflash`) is verified
    as a tree of that many drafted nodes (`spec.tree`: chosen per block by the drafter's marginals), greedy or
    sampled rows alike (`tree_step`)."""
    if not whole(block_size) or block_size < 2:
        raise SparseSpecError(f"block size must be a whole number >= 2 (one pending token + proposals), got "
                              f"{block_size!r}")
    if not isinstance(drafter, Drafter):
        raise SparseSpecError(f"drafter must be a Drafter (sparsespec.spec.bench.make_drafter(spec, engine, name) "
                              f"makes one; \"none\" is plain decoding: Engine.generate), got {drafter!r}")
    if engine.config.sliding_window is not None:
        raise SparseSpecError("speculative decoding does not support sliding-window models yet")
    engine.check_all_fit(prompts, gen.max_new_tokens)
    if not prompts:
        return []
    called = time.perf_counter()
    tree = tree_verify(drafter, block_size, engine.device)
    # per row, room for a whole block past its last new token (else its last steps run eagerly at their own width)
    widest = max(block_size, drafter.tree_nodes + 1)  # a tree verify may be wider than the block
    rooms = [min(len(p) + gen.max_new_tokens + widest, engine.config.max_position) for p in prompts]
    capacity = loop_capacity(max(rooms), engine.config.max_position, gen.compile, runners is not None,
                             drafter.policy is not None)
    if runners is not None and drafter.policy is None:
        runner = runners.get(engine.model, len(prompts), capacity, gen.cuda_graph, gen.compile, drafter.taps)
    else:
        runner = Runner(engine.model, len(prompts), capacity, drafter.policy, cuda_graph=gen.cuda_graph,
                        compile=gen.compile, taps=drafter.taps)
    drafter.bind(runner)
    rngs = [make_generator(gen.sampling, engine.device) for _ in prompts]

    start = time.perf_counter()
    hidden, features = runner.prefill_tapped(prompts, gen.prefill_chunk)  # [B, H], [B, T, taps * H] or None
    drafter.start(prompts, None if features is None else [features[r, :len(p)] for r, p in enumerate(prompts)],
                  capacity)
    logits = engine.model.logits(hidden)  # [B, V]
    firsts = [int(sample(logits[r:r + 1], gen.sampling, rngs[r])[0]) for r in range(len(prompts))]
    ttft = time.perf_counter() - start

    if gen.cuda_graph:  # set-up, timed neither as first token nor decoding: the graphs captured (and compiled) now
        runner.capture_verify(block_size)
        if tree is not None:
            runner.capture_verify(tree.n + 1, tree=True)
            tree.bind(runner)
        drafter.capture()
    histories = [list(p) + [f] for p, f in zip(prompts, firsts)]
    outs = [[f] for f in firsts]
    live = [not engine._stopped(out, gen) for out in outs]
    committed_per_step: list[list[int]] = [[] for _ in prompts]
    copied_per_step: list[list[bool]] = [[] for _ in prompts]
    start = time.perf_counter()
    setup = start - called - ttft
    while any(live):
        lengths = runner.cache.lengths  # row r's pending token goes to slot lengths[r] (= len(history) - 1)
        ks = [min(block_size - 1, room - n - 1) if on else 0 for room, n, on in zip(rooms, lengths, live)]
        # a stopped row is parked at slot 0
        commits = speculative_step(runner, drafter, [h if on else None for h, on in zip(histories, live)], ks,
                                   [gen.sampling] * len(prompts), rngs, block_size, [0] * len(prompts),
                                   tree)
        sources = drafter.copied()
        for r, new in enumerate(commits):
            if new is None:
                continue
            histories[r] += new
            used = 0  # tokens of this step that reach the output (a stop may cut the step short)
            for t in new:
                outs[r].append(t)
                used += 1
                if engine._stopped(outs[r], gen):
                    live[r] = False
                    break
            committed_per_step[r].append(used)
            if sources is not None:
                copied_per_step[r].append(sources[r])
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    decode_s = time.perf_counter() - start
    return [SpecGeneration(out, engine._text(out, gen), len(p), ttft, decode_s, steps, copies, setup)
            for out, p, steps, copies in zip(outs, prompts, committed_per_step, copied_per_step)]


def tree_verify(drafter: Drafter, block_size: int, device: torch.device) -> TreeVerify | None:
    """The drafter's tree verify (None for a line: no `tree_nodes`), after checking that it can draft one; the
    drafter set to draft choices (or its line)."""
    nodes = drafter.tree_nodes
    if not nodes:
        drafter.choices(0)
        return None
    if not drafter.marginals:
        raise SparseSpecError(f"a tree verify needs a drafter of per-position choices (dflash), not {drafter.name}")
    # a tree's paths are at most as deep as the block, and as the drafter's own block (which caps a line alike)
    depth = block_size - 1 if drafter.max_proposals is None else min(block_size - 1, drafter.max_proposals)
    kept = drafter.tree  # the last call's (its captured graphs kept): a loop over many prompts builds it once
    where = torch.empty(0, device=device).device  # (with its index: "cuda" is "cuda:0")
    if kept is None or (kept.n, kept.pool.width, kept.pool.ranks.device) != (nodes, depth, where):
        pool = Pool.of(depth, device=device)
        if not 1 <= nodes <= min(MAX_NODES, pool.ranks.shape[0]):
            raise SparseSpecError(f"a tree verify of paths up to {depth} deep (block size {block_size}) takes 1 to "
                                  f"{min(MAX_NODES, pool.ranks.shape[0])} nodes, got {nodes}")
        drafter.tree = kept = TreeVerify(pool, nodes)
    drafter.choices(kept.pool.ranks_needed)
    return kept


def speculative_step(runner: Runner, drafter: Drafter, histories: list[list[int] | None], ks: list[int],
                     cfgs: list[SamplingConfig], rngs: list[torch.Generator | None], block_size: int,
                     parked: list[int], tree: TreeVerify | None = None) -> list[list[int] | None]:
    """One draft-verify-commit step of every row of the runner's batch. histories[r]: row r's committed tokens, the
    last one pending (its slot is the row's length), or None for a row that does not decode now (it rides along at
    parked[r] slots and is left there); up to ks[r] proposals drawn under cfgs[r] with rngs[r]. -> per row the tokens
    it commits (its accepted proposals, then the target's next token), None where it does not decode. The runner
    and the drafter are left at each decoding row's new length."""
    if any(h is None and n != p for h, n, p in zip(histories, runner.cache.lengths, parked)):
        # a row that does not decode rides along from its parked slot (a self-drafter steps every row: a row that
        # stopped after a whole block, left at its end, could step past the cache)
        runner.truncate([p if h is None else n for h, n, p in zip(histories, runner.cache.lengths, parked)])
    lengths = list(runner.cache.lengths)
    live = [h is not None for h in histories]
    greedy = all(c.greedy for c, on in zip(cfgs, live) if on)
    # every row's block is written from its length on: near the context's end the widest block must fit too
    room = runner.cache.capacity - max(lengths)
    pending = [h[-1] if on else 0 for h, on in zip(histories, live)]
    if tree is not None and room > tree.n:  # (a row's proposal budget limits its tree's depth: `choose`)
        return tree_step(runner, drafter, histories, ks, cfgs, rngs, tree, lengths, pending, parked)
    # drafts drawn on the device stay there (the verify is queued right behind them) when they do not depend on
    # the sampling: every row greedy, or a drafter of point-mass proposals
    point = greedy or drafter.point_mass
    if point:
        drafts, counts = drafter.propose_greedy(histories, ks, runner.device)  # [B, K], row r's first counts[r]
        width = min(1 + max(counts), room)
        counts = [min(c, k, width - 1) for c, k in zip(counts, ks)]
        block = torch.cat([device_ints(pending, runner.device)[:, None], drafts[:, :width - 1]], 1)  # [B, width]
    else:
        proposals, probs = drafter.propose(histories, ks, cfgs, rngs)
        width = min(1 + max(len(p) for p in proposals), room)
        proposals = [p[:min(k, width - 1)] for p, k in zip(proposals, ks)]
        block = device_ints([[t] + p + [t] * (width - 1 - len(p)) for t, p in zip(pending, proposals)],
                            runner.device)
    logits, features = runner.verify(block, block_size)  # [B, width, V]
    if greedy:  # every row at once, one read-back
        commits = [new if on else None for new, on in zip(verify_greedy_rows(block[:, 1:], counts, logits), live)]
    elif point:  # each row with its own settings and generator (as alone), one read-back
        commits = verify_sampling_rows(block[:, 1:], counts, logits, cfgs, rngs, live)
    else:  # row by row, each with its own settings, generator and drafted distributions (as alone)
        commits = [verify_sampling(torch.tensor(p, dtype=torch.long, device=logits.device),
                                   None if q is None else q[:len(p)], logits[r, :len(p) + 1], cfgs[r], rngs[r])
                   if on else None for r, (p, q, on) in enumerate(zip(proposals, probs, live))]
    accepted = [None if c is None else len(c) - 1 for c in commits]
    runner.truncate([n + a + 1 if a is not None else rest for n, a, rest in zip(lengths, accepted, parked)])
    drafter.commit([None if c is None else len(h) + len(c) for h, c in zip(histories, commits)], accepted,
                   features)  # [B, width, taps * hidden] or None
    return commits


def tree_step(runner: Runner, drafter: Drafter, histories: list[list[int] | None], ks: list[int],
              cfgs: list[SamplingConfig], rngs: list[torch.Generator | None], tree: TreeVerify,
              lengths: list[int], pending: list[int], parked: list[int]) -> list[list[int] | None]:
    """`speculative_step` as a tree verify: the drafter's choices -> a tree of n nodes a row, no deeper than its
    ks[r] proposals (`tree.choose`) -> one verify of the n + 1 tokens -> the target's token after every
    node -> the deepest node whose path the target's tokens follow (`tree.accept`), one read-back; its path's K/V
    (and features) are moved to the slots after the row's pending token, as a line verify would have left them.

    The target's token after a node is its argmax for a greedy row, and for a sampled row a draw from its
    distribution there (cfgs[r]: temperature, top-k, top-p; rngs[r]), each node's draw independent. Walking from
    the root, every committed token is then a draw from the target given the tokens before it, whatever the tree
    (chosen before the verify, from the drafter alone): sampled output is distributed as plain sampling's. A node
    is entered with the probability the target gives its token, as speculative sampling accepts a point-mass
    proposal, so a tree commits more than the line at T > 0 as at T = 0; draws at nodes off the walked path are
    dropped (independent of it, they bias nothing)."""
    n, width, dev = tree.n, tree.pool.width, runner.device
    tree.bind(runner)  # (a scheduler's first tree step; a loop's set-up did it)
    ids, logp, _ = drafter.propose_choices(histories, ks, dev)  # [B, K, R] each
    # [B] each: the pending tokens, their slots, each row's deepest path (its proposal budget), whether it decodes
    rows = device_ints([pending, lengths, [min(k, width) for k in ks], [h is not None for h in histories]], dev)
    block, plan = tree.draft(ids[:, :width], logp[:, :width], rows[0], rows[2])  # [B, n + 1]
    logits, features = runner.verify(block, n + 1, tree=plan)
    targets = logits.argmax(-1)  # [B, n + 1]: the target's token after each node
    for r, (h, cfg, rng) in enumerate(zip(histories, cfgs, rngs)):
        if h is not None and not cfg.greedy:
            targets[r] = sample(logits[r], cfg, rng)  # [n + 1] independent draws
    out, features = tree.settle(targets, features, rows[3] != 0, rows[1], runner.cache)
    commits: list[list[int] | None] = []
    for h, row in zip(histories, out.tolist()):  # the step's one read-back
        p = path(row[0])  # the accepted path's block indices, the root first
        commits.append(None if h is None else [row[n + 1 + j] for j in p[1:]] + [row[1 + p[-1]]])
    accepted = [None if c is None else len(c) - 1 for c in commits]
    runner.truncate([n0 + a + 1 if a is not None else rest for n0, a, rest in zip(lengths, accepted, parked)])
    drafter.commit([None if c is None else len(h) + len(c) for h, c in zip(histories, commits)], accepted,
                   features)
    return commits
