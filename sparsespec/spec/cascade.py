"""A cascade (issue 15's hierarchy): a block drafter (DFlash) proposes to the target under a sparse attention
policy, whose block passes verify the proposals; the tokens the sparse target keeps go to the loop's dense verify
(decode.py), which decides every token.

    propose (up to k tokens a row, for one dense verify step):
      round:  drafts [B, b] = DFlash's block after each row's last token     (its context: the committed tokens'
                                                                               features, then this cycle's sparse ones)
              logits [B, b + 1, V] = runner.sparse_verify([last, drafts])     (each sparse layer selects at the first
                                                                               query; every query attends to that
                                                                               selection and the block up to itself)
              row r keeps its accepted drafts and the sparse target's next token (greedy: the argmax prefix; sampled:
              speculative sampling, so each kept token is a draw from the sparse target given those before it);
              the runner and DFlash advance over them (their sparse K/V and features)
      until each row has k tokens (a row that has them rides along); then both go back to the cycle's start
    -> the kept tokens, and for a sampled row the sparse target's distribution at each (what it was drawn from)

The dense verify accepts each token with min(1, p / q), q the sparse target's distribution: the output is the dense
model's, greedy or sampled. A round costs one DFlash forward and one sparse pass, which at long context reads the
weights and a selection of the cache (a budget of keys a KV head), where the self-drafter (`SelfDrafter`) takes a
sparse decode step for every proposal.
"""

from __future__ import annotations

import torch

from ..attention.policy import Policy, device_ints
from ..errors import SparseSpecError
from ..runner import Runner
from .dflash import DFlashDrafter
from .drafters import Drafter, Rows
from .verify import draft_distribution, verify_greedy_rows, verify_sampling_rows


class Cascade(Drafter):
    """`--draft DRAFTER>self:POLICY[:key=value,...]` (e.g. dflash>self:binarypc): `lower` (a DFlash drafter, its
    line) drafts for the target under `policy`, as the module says. `fp8`: the sparse passes multiply with FP8 copies
    of the target's weights (`Runner.fp8_decode`; the dense verify keeps the model's)."""

    def __init__(self, lower: Drafter, policy: Policy, name: str, fp8: bool = False):
        if not isinstance(lower, DFlashDrafter) or lower.tree_nodes:
            raise SparseSpecError(f"a cascade's lower drafter is a DFlash drafter's line (dflash[:PATH] or "
                                  f"windowN:dflash[:PATH]), not {lower.name}")
        if not policy.blocks:
            raise SparseSpecError(f"a cascade's sparse level needs a policy that selects keys for a block of queries "
                                  f"(binarypc, topk, quest, doublesparse, streaming, magicpig), not {policy.name}")
        self.lower, self.policy, self.name, self.fp8 = lower, policy, name, fp8
        self.taps = lower.taps
        # the dense verify's features go to DFlash's context, a block at most: no more proposals than its block
        self.max_proposals = lower.max_proposals
        self.runner: Runner | None = None
        # per row since its start: sparse passes it took a token from, and the tokens they kept (their ratio: the
        # sparse level's τ, tokens per pass)
        self.passes: list[int] = []
        self.kept: list[int] = []

    def bind(self, runner):
        self.runner = runner
        if self.fp8:
            runner.fp8_decode()
        self.lower.bind(runner)

    def start(self, prompts, features, capacity):
        if self.runner is None:
            raise SparseSpecError("the cascade drafts through the target's runner: bind it first")
        self.lower.start(prompts, features, capacity)
        self.passes, self.kept = [0] * len(prompts), [0] * len(prompts)

    def capture(self):
        """DFlash's graphs, and the sparse passes' of every width a pass of the loop's verify block can take (a pass
        keeps fewer tokens than the block holds), selecting and reusing."""
        self.lower.capture()
        block = max((w for w, tree in self.runner.verify_graphs if not tree), default=self.max_proposals + 2)
        for width in sorted({self._graph_width(w) for w in range(1, min(block, self.max_proposals + 2))}):
            for reuse in (False, True)[:1 + (self.policy.options.select_every > 1)]:
                self.runner.capture_sparse(width, reuse)

    def _graph_width(self, width: int) -> int:
        """The width of the graph that runs a pass of `width` tokens: the next power of two, at most DFlash's block
        (a pass's products grow with its rows: a round that wants few tokens should not pay for a whole block)."""
        return min(1 << (width - 1).bit_length(), self.max_proposals + 1)

    def start_row(self, row, prompt, features):
        """(The target's runner builds the row's index: `Runner.index_row`.)"""
        self.lower.start_row(row, prompt, features)
        self.passes[row] = self.kept[row] = 0

    def stats(self, row):
        return {"sparse_passes": self.passes[row], "sparse_kept": self.kept[row]}

    @torch.inference_mode()
    def propose(self, histories: Rows, ks, cfgs, rngs):
        runner, lower = self.runner, self.lower
        start = list(runner.cache.lengths)  # row r's pending token (its history's last) goes to slot start[r]
        want = [0 if h is None else max(0, min(k, self.max_proposals)) for h, k in zip(histories, ks)]
        rows = [None if h is None else list(h) for h in histories]  # each history with this cycle's kept tokens
        kept: list[list[int]] = [[] for _ in histories]
        dists: list[list[torch.Tensor]] = [[] for _ in histories]
        every = self.policy.options.select_every
        selected: list[int | None] = [None] * len(histories)  # per row, the position of its last selecting pass
        while True:
            left = [w - len(t) for w, t in zip(want, kept)]
            room = runner.cache.capacity - max(runner.cache.lengths)
            if not any(n > 0 for n in left) or room < 1:
                break
            # a row with tokens left takes up to left - 1 drafts: the pass adds the sparse target's own next token
            drafts, counts = lower.propose_greedy(rows, [max(n - 1, 0) for n in left], runner.device)  # [B, K]
            width = min(1 + max(counts), room)
            counts = [min(c, width - 1) for c in counts]
            pending = device_ints([0 if r is None else r[-1] for r in rows], drafts.device)  # [B]
            block = torch.cat([pending[:, None], drafts[:, :width - 1]], 1)  # [B, width]
            live = [n > 0 for n in left]
            # select_every = N > 1: a row reuses its last selection while its block lies within N - 1 slots of it (its
            # own rule, as alone); a row that does not decode this pass reuses whatever it has (its result unused)
            reuse = [every > 1 and s is not None and (n + 1 + c <= s + every or not on)
                     for n, c, s, on in zip(runner.cache.lengths, counts, selected, live)]
            selected = [s if keep else n for n, s, keep in zip(runner.cache.lengths, selected, reuse)]
            logits, features = runner.sparse_verify(block, self._graph_width(width), reuse)  # [B, width, V]
            if all(c.greedy for c, on in zip(cfgs, live) if on):  # every row at once, one read-back
                commits = [new if on else None for new, on in zip(verify_greedy_rows(block[:, 1:], counts, logits),
                                                                   live)]
            else:  # each row with its own settings and generator, one read-back
                commits = verify_sampling_rows(block[:, 1:], counts, logits, cfgs, rngs, live)
            for r, new in enumerate(commits):
                if new is not None:
                    kept[r] += new
                    rows[r] += new
                    self.passes[r] += 1
                    self.kept[r] += len(new)
                    if not cfgs[r].greedy:  # each kept token was drawn from the sparse target's distribution there
                        dists[r].append(draft_distribution(logits[r, :len(new)], cfgs[r]))  # [len(new), V]
            runner.truncate([n if c is None else n + len(c) for n, c in zip(runner.cache.lengths, commits)])
            # DFlash's context takes the kept tokens' features (a row that kept none is put back where it was)
            lower.commit([None if c is None else len(r) for r, c in zip(rows, commits)],
                         [None if c is None else len(c) - 1 for c in commits], features)
            lower.rollback([0 if r is None else len(r) - 1 for r in rows])
        runner.truncate(start)  # the dense verify writes these slots again, densely (the index follows)
        lower.rollback([0 if h is None else len(h) - 1 for h in histories])
        return kept, [torch.cat(d) if d else None for d in dists]

    def commit(self, lengths, accepted, features):
        self.lower.commit(lengths, accepted, features)
