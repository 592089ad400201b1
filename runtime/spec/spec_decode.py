"""One speculative decode step over a scheduled decode batch (issue 13, item 7).

    spec = SpecDecoder(proposer, planner, window_kind, cache, cache_spec, max_rows)
    result = spec.run(batch, executor, table, sample)   # draft -> plan -> verify -> accept -> commit

The scheduler built `batch` as a plain decode step (each row's input is its last committed token, the
anchor). Here every row that can speculate (greedy, no penalties, bias, guide or logprobs: what the
accepted drafts' argmax would not reproduce) gets gamma drafts from the proposer; the planner keeps a
prefix of each; the target verifies anchor + kept drafts in one verify step (MLA appends KV, KDA
writes the draft window, not the state); the anchor's logits are sampled by the engine's own sampler
(so every request, speculating or not, gets exactly the token decode would give it); drafts are
accepted while they equal the target's greedy token; sampled rows (temperature > 0, top-k, top-p)
instead go through rejection sampling (acceptance.verify_sampled) against the very distribution the
sampler would draw from; the commit folds (ReplaySSM) or selects (snapshot) each request's accepted
prefix into its state slot and rolls its conv windows.

Greedy output is therefore the non-speculative output token for token (up to the verify step's
floating-point rounding, which differs from decode's the way any batch shape does), and sampled output
has the non-speculative distribution. Rows that cannot speculate verify their anchor alone: a decode
step. Proposers that read target features (DSpark) get the rows of the positions each step committed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec
from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT, check_layout
from k3compile.runtime.executor import next_bucket
from k3compile.runtime.memory.base import OutOfMemoryError
from k3compile.runtime.sampler import sampling_probs

from .acceptance import verify_sampled
from .fold_kernel import commit
from .planner import Planner
from .proposer import DraftRequest


def can_speculate(req) -> bool:
    """Greedy or plain sampling (temperature, top-k, top-p): what exact match / rejection sampling verify
    losslessly. Penalties, bias and guides change the distribution per committed token; logprobs and
    n > 1 groups want the sampler's own per-token outputs."""
    p = req.params
    return (not p.penalized and not p.logit_bias and p.guide is None and p.logprobs is None
            and not req.followers)


@dataclass
class SpecStats:
    steps: int = 0
    rows: int = 0  # request-steps that speculated
    drafted: int = 0  # drafts proposed for them
    verified: int = 0  # drafts kept by the planner and verified
    decode_steps: int = 0  # steps the planner ran as plain decode (no verify paid off)
    accepted: int = 0  # drafts accepted
    committed: int = 0  # tokens committed by speculating rows (accepted + the target's own)
    history: list = field(default_factory=list)  # (batch, verify tokens, accepted) per step, for benches

    @property
    def accept_length(self) -> float:
        """Mean tokens a speculating request commits per step (accepted drafts + 1)."""
        return self.committed / self.rows if self.rows else 0.0


@dataclass
class SpecResult:
    sampled: object  # BatchSample of the anchors (the engine's sampler)
    errors: dict[int, str]
    extra: dict[int, list[int]]  # row -> accepted tokens after the sampled one


class SpecDecoder:
    def __init__(self, proposer, planner: Planner, window_kind: str, cache_spec, max_rows: int, device="cpu",
                 kda_launch: str = DEFAULT_LAYOUT):
        self.proposer, self.planner = proposer, planner
        self.kda_launch = check_layout(kda_launch)  # P5's launch layout: the fold reproduces its blocks
        self.gamma = int(proposer.gamma)
        self.feature_layers = tuple(proposer.feature_layers)  # the executor's prefill / verify steps emit them
        self._features: dict[str, tuple[int, torch.Tensor]] = {}  # rid -> (first position, rows) committed, not passed yet
        self.window = DraftWindow.allocate(DraftWindowSpec(cache_spec, self.gamma + 1, window_kind), max_rows, device)
        self.stats = SpecStats()

    @property
    def window_bytes(self) -> int:
        return self.window.spec.bytes_per_request() * self.window.rows

    def run(self, batch, executor, table, page_size: int, max_context: int, sample) -> SpecResult | None:
        """One speculative step for a decode batch; None when the planner chose a plain decode step instead
        (the caller runs it)."""
        rows = batch.rows
        if len(rows) > self.window.rows:
            raise ValueError(f"{len(rows)} requests in a speculative step, the draft window has {self.window.rows} rows")
        live = [not r.req.finished and r.req.handle is not None and not r.req.void for r in rows]
        spec_rows = [i for i, r in enumerate(rows) if live[i] and can_speculate(r.req)]
        keep = [0] * len(rows)
        drafts, block = None, None
        if spec_rows:
            block = self.proposer.propose([DraftRequest(rows[i].req.rid, rows[i].req.all_ids[: rows[i].start + 1],
                                                        rows[i].req.params.temperature) for i in spec_rows])
            drafts = block.tokens.tolist()
            limits = []
            for i in spec_rows:
                r = rows[i]
                left = r.req.params.max_new_tokens - len(r.req.output_ids) - 1  # tokens after the sampled one
                limits.append(max(0, min(self.gamma, left, max_context - r.start - 1)))
            plan = self.planner.plan(block.confidence, limits)
            if plan.decode and not self.feature_layers:  # (a drafter that reads features needs the verify step's)
                self.stats.decode_steps += 1
                return None
            for j, i in enumerate(spec_rows):
                keep[i] = self._pages_for(table, rows[i], plan.keep[j])
        # the verify step: anchor + kept drafts per row
        ids, tables, slots = [], [], []
        spec_index = {i: j for j, i in enumerate(spec_rows)}
        for i, r in enumerate(rows):
            anchor = r.req.token_at(r.start) if r.start < r.req.num_tokens else 0
            ids.append([anchor] + (drafts[spec_index[i]][: keep[i]] if keep[i] else []))
            h = r.req.handle
            tables.append(table.page_table(h)[: -(-(r.start + 1 + keep[i]) // page_size)] if h is not None
                          else batch.forward.page_table[i].tolist())
            slots.append(int(batch.forward.state_slots[i]))
        fb = ForwardBatch.build(self.window.spec.step_mode, ids, [r.start for r in rows], tables, slots, page_size,
                                device=batch.forward.input_ids.device, logits="all")
        out = executor.run_verify(fb)
        logits, feats = out if isinstance(out, tuple) else (out, None)
        starts = fb.cu_seqlens[:-1].long()
        # sampled rows with drafts commit what rejection sampling gives; the engine's sampler takes the rest
        rs = [i for i in spec_rows if keep[i] and not rows[i].req.params.greedy]
        if rs:
            skip = set(rs)
            sampled, errors = sample(replace(batch, rows=[replace(r, samples=False) if i in skip else r
                                                          for i, r in enumerate(rows)]), logits[starts])
            committed = self._rejection_sample(rows, rs, keep, drafts, block.probs, spec_index, logits, starts)
        else:
            sampled, errors = sample(batch, logits[starts])
            committed = {}
        extra, accept = {}, []
        forced = block.forced.tolist() if block is not None and block.forced is not None else None
        for i, r in enumerate(rows):
            if i in committed:
                sampled.tokens[i], got = committed[i][0], committed[i][1:]
                accept.append(len(committed[i]))
                if got:
                    extra[i] = got
                continue
            tok = sampled.tokens[i]
            if not live[i] or tok is None or i in errors:
                accept.append(1 if live[i] else 0)
                continue
            got = []
            if keep[i]:
                d = drafts[spec_index[i]][: keep[i]]
                best = logits[int(starts[i]) + 1: int(starts[i]) + 1 + keep[i]].argmax(-1).tolist()
                if forced is not None:  # benchmark coin flips: commit the first n drafts, then the target's token
                    n = 0
                    while n < keep[i] and forced[spec_index[i]][n]:
                        n += 1
                    if n:
                        sampled.tokens[i], got = d[0], d[1:n] + [best[n - 1]]
                else:
                    while len(got) < keep[i] and d[len(got)] == tok:
                        tok = best[len(got)]
                        got.append(tok)
            accept.append(1 + len(got))
            if got:
                extra[i] = got
        # the decode step this replaces would have run at the batch's graph bucket: its kernel blocks. The verify
        # graph's window inputs (P16's k3::kda_verify_inputs) took the blocks of its own rows, the same bucket:
        # the engine sizes the window to next_bucket(max_running), so every decode bucket is a verify bucket
        decode_batch = (next_bucket(len(rows), executor.buckets) if executor.pad_to_buckets else None) or len(rows)
        commit(executor.cache, self.window, slots, accept, decode_batch=decode_batch, layout=self.kda_launch)
        if feats is not None:  # the anchor's and the accepted drafts' features: the positions now committed
            for i, r in enumerate(rows):
                if accept[i]:
                    a = int(starts[i])
                    self._features[r.req.rid] = (r.start, feats[a: a + accept[i]])
        self._note(rows, spec_rows, keep, accept)
        return SpecResult(sampled, errors, extra)

    def _rejection_sample(self, rows, rs, keep, drafts, draft_probs, spec_index, logits, starts) -> dict:
        """Rows `rs` (temperature > 0, keep[i] drafts verified): rejection sampling against the sampler's
        own distribution (sampling_probs) at the anchor and after each draft. Seeded requests draw from
        their own generator (on the CPU, one row at a time, so a seed reproduces); the others share one
        batched draw. Returns row -> tokens to commit (accepted drafts, then the target's token)."""
        g = max(keep[i] for i in rs)
        vocab = logits.shape[-1]
        idx = torch.stack([starts[i] + torch.arange(g + 1, device=starts.device).clamp(max=keep[i]) for i in rs])
        params = [rows[i].req.params for i in rs]
        target = sampling_probs(logits[idx.reshape(-1)], [p for p in params for _ in range(g + 1)])
        target = target.view(len(rs), g + 1, vocab)
        d_tok = torch.tensor([(drafts[spec_index[i]] + [0] * g)[:g] for i in rs], device=logits.device)
        d_prob = None
        if draft_probs is not None:
            d_prob = draft_probs[[spec_index[i] for i in rs], :g].to(device=logits.device, dtype=torch.float32)
        n_draft = torch.tensor([keep[i] for i in rs], device=logits.device)
        out = {}
        shared = [j for j, i in enumerate(rs) if rows[i].req.generator is None]
        if shared:
            sel = torch.tensor(shared, device=logits.device)
            res = verify_sampled(d_tok[sel], None if d_prob is None else d_prob[sel], target[sel], n_draft[sel])
            out.update({rs[j]: toks for j, toks in zip(shared, res.rows())})
        for j, i in enumerate(rs):
            gen = rows[i].req.generator
            if gen is None:
                continue
            res = verify_sampled(d_tok[j: j + 1].cpu(), None if d_prob is None else d_prob[j: j + 1].cpu(),
                                 target[j: j + 1].cpu(), n_draft[j: j + 1].cpu(), generator=gen)
            out[i] = res.rows()[0]
        return out

    @staticmethod
    def _pages_for(table, row, n: int) -> int:
        """Pages for the anchor + n drafts; fewer drafts (down to none) when memory is short."""
        while n > 0:
            try:
                table.ensure_pages(row.req.handle, row.start + 1 + n)
                return n
            except OutOfMemoryError:
                n //= 2
        return 0

    def _note(self, rows, spec_rows, keep, accept) -> None:
        s = self.stats
        s.steps += 1
        s.rows += len(spec_rows)
        s.drafted += self.gamma * len(spec_rows)
        s.verified += sum(keep)
        acc = sum(accept[i] - 1 for i in spec_rows)
        s.accepted += acc
        s.committed += sum(accept[i] for i in spec_rows)
        s.history.append((len(rows), len(rows) + sum(keep), acc))

    def observe(self, reqs) -> None:
        """After the scheduler applied a step: tell the proposer what each request committed (with the
        target features of the positions the step committed, for proposers that read them); release
        finished ones."""
        for req in reqs:
            got = self._features.pop(req.rid, None)
            if req.finished:
                self.proposer.release(req.rid)
            elif not self.feature_layers:
                self.proposer.observe(req.rid, req.all_ids, None)
            elif got is not None:
                self.proposer.observe(req.rid, req.all_ids, got[1], start=got[0])

    def release(self, rid: str) -> None:
        """The request is gone (finished or aborted): forget it."""
        self._features.pop(rid, None)
        self.proposer.release(rid)

    def observe_prefill(self, batch, features: torch.Tensor) -> None:
        """After the scheduler applied a prefill batch: each live row's features (positions
        [row.start, row.end), packed in row order) go to the proposer; requests that finished there are
        released. Positions a cached prefix skipped have none (the proposer drafts from fewer rows)."""
        lens = batch.forward.extend_lens_cpu
        first = 0
        for row, n in zip(batch.rows, lens):
            req = row.req
            if req.finished:
                self.proposer.release(req.rid)
            elif not req.void and req.handle is not None:
                self.proposer.observe(req.rid, req.all_ids, features[first: first + n], start=row.start)
            first += n
