"""Measured acceptance of a drafter against its target: real greedy speculative decoding on the eager
target (prefill-mode verify of [anchor, drafts] with features, exact-match acceptance, KDA state rolled
back by restoring a slot snapshot and re-reading the accepted prefix), next to plain greedy decoding of
the same prompts, whose output it must reproduce token for token.

Reported per gamma: tau = committed tokens per verify step (accepted drafts + 1), the per-position
conditional acceptance rate next to the drafter's mean confidence there (calibration), and whether the
output equals plain greedy decoding.
"""
from __future__ import annotations

import time

import torch

from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.loader import load_model
from k3compile.runtime.spec.acceptance import verify_greedy
from k3compile.runtime.spec.dspark_proposer import DSparkProposer
from k3compile.runtime.spec.proposer import DraftRequest

from .corpus import Corpus

PAGE = 16


class EagerTarget:
    """Requests 0..B-1 on slots 1..B (snapshots in slots B+1..2B), each with its own run of pages."""

    def __init__(self, model, n: int, max_len: int):
        self.model, self.n = model, n
        self.device = model.lm_head.weight.device
        self.pages = -(-max_len // PAGE)
        self.cache = CacheTensors.allocate(model.cache_spec(), 2 * n + 1, n * self.pages + 1, PAGE, device=self.device)
        self.lens = [0] * n

    def run(self, reqs: list[int], tokens: list[list[int]], feature_layers=(), logits="last"):
        rows = [list(range(1 + r * self.pages, 1 + (r + 1) * self.pages)) for r in reqs]
        mode = "decode" if all(len(t) == 1 for t in tokens) and logits == "last" else "prefill"
        batch = ForwardBatch.build(mode, tokens, [self.lens[r] for r in reqs], rows, [1 + r for r in reqs], PAGE,
                                   device=self.device, logits=logits, max_pages=self.pages)
        out = self.model.step(batch, self.cache, feature_layers=feature_layers)
        for r, t in zip(reqs, tokens):
            self.lens[r] += len(t)
        return out

    def _slots(self, reqs, base):
        return torch.tensor([base + r for r in reqs], device=self.device)

    def snapshot(self, reqs):
        self.cache.copy_slot(self._slots(reqs, 1), self._slots(reqs, 1 + self.n))

    def restore(self, reqs, lens):
        self.cache.copy_slot(self._slots(reqs, 1 + self.n), self._slots(reqs, 1))
        for r, n in zip(reqs, lens):
            self.lens[r] = n


@torch.no_grad()
def greedy_decode(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    t = EagerTarget(model, len(prompts), max(map(len, prompts)) + new_tokens + 1)
    reqs = list(range(len(prompts)))
    nxt = t.run(reqs, prompts).argmax(-1).tolist()
    out = [[x] for x in nxt]
    for _ in range(new_tokens - 1):
        nxt = t.run(reqs, [[x] for x in nxt]).argmax(-1).tolist()
        for o, x in zip(out, nxt):
            o.append(x)
    return out


@torch.no_grad()
def speculative_greedy(model, proposer: DSparkProposer, prompts: list[list[int]], new_tokens: int) -> dict:
    gamma, layers = proposer.gamma, proposer.feature_layers
    t = EagerTarget(model, len(prompts), max(map(len, prompts)) + new_tokens + gamma + 2)
    reqs = list(range(len(prompts)))
    logits, feats = t.run(reqs, prompts, layers)
    committed = [list(p) + [x] for p, x in zip(prompts, logits.argmax(-1).tolist())]
    for r, f in zip(reqs, feats.split([len(p) for p in prompts])):
        proposer.observe(str(r), prompts[r], f)
    steps, emitted = 0, 0
    hits = torch.zeros(gamma)
    tries = torch.zeros(gamma)
    conf_sum = torch.zeros(gamma)
    while True:
        live = [r for r in reqs if len(committed[r]) - len(prompts[r]) < new_tokens]
        if not live:
            break
        block = proposer.propose([DraftRequest(str(r), committed[r], 0.0) for r in live])
        t.snapshot(live)
        before = [t.lens[r] for r in live]
        logits, feats = t.run(live, [[committed[r][-1]] + d for r, d in zip(live, block.tokens.tolist())], layers,
                              logits="all")
        res = verify_greedy(block.tokens, logits.view(len(live), gamma + 1, -1))
        acc = res.accepted.tolist()
        feats = feats.view(len(live), gamma + 1, -1)
        redo = [i for i, n in enumerate(acc) if n < gamma]
        keep = {i: feats[i] for i in range(len(live)) if acc[i] == gamma}
        if redo:  # roll the KDA state back and re-read only the accepted prefix
            t.restore([live[i] for i in redo], [before[i] for i in redo])
            _, f2 = t.run([live[i] for i in redo], [[committed[live[i]][-1]] + block.tokens[i, : acc[i]].tolist()
                                                   for i in redo], layers, logits="all")
            keep.update(zip(redo, f2.split([acc[i] + 1 for i in redo])))
        for i, r in enumerate(live):
            new = res.rows()[i]
            proposer.observe(str(r), new, keep[i][: acc[i] + 1])
            committed[r] += new
            n = acc[i]
            tries[: min(n + 1, gamma)] += 1
            hits[:n] += 1
            conf_sum[: min(n + 1, gamma)] += block.confidence[i, : min(n + 1, gamma)].cpu()
        steps += len(live)
        emitted += sum(a + 1 for a in acc)
    for r in reqs:
        proposer.release(str(r))
    out = [c[len(p): len(p) + new_tokens] for c, p in zip(committed, prompts)]
    return {"outputs": out, "verify_steps": steps, "tau": emitted / steps,
            "accept_rate_by_position": (hits / tries.clamp_min(1)).tolist(),
            "confidence_by_position": (conf_sum / tries.clamp_min(1)).tolist()}


def measure_acceptance(target_path: str, drafter_path: str, gammas=(4, 6, 8), n_prompts: int = 8,
                       new_tokens: int = 64, prompt_len: int = 64, seed: int = 0, device: str = "cpu",
                       corpus_bytes: int = 4 << 20) -> dict:
    model = load_model(target_path, dtype=torch.float32, device=device, progress=False)
    gen = torch.Generator().manual_seed(seed + 2)
    prompts = Corpus(corpus_bytes).batch("val", n_prompts, prompt_len, gen).tolist()
    start = time.time()
    plain = greedy_decode(model, prompts, new_tokens)
    result = {"prompts": n_prompts, "prompt_len": prompt_len, "new_tokens": new_tokens, "by_gamma": {}}
    for g in gammas:
        proposer = DSparkProposer.from_checkpoint(drafter_path, model, gamma=g, seed=seed)
        spec = speculative_greedy(model, proposer, prompts, new_tokens)
        same = sum(a == b for a, b in zip(spec.pop("outputs"), plain))
        result["by_gamma"][g] = {**{k: (round(v, 4) if isinstance(v, float) else [round(x, 3) for x in v]
                                        if isinstance(v, list) else v) for k, v in spec.items()},
                                 "mean_accepted_drafts": round(spec["tau"] - 1, 4),
                                 "outputs_equal_plain_greedy": f"{same}/{n_prompts}"}
        print(f"[acceptance] gamma {g}: tau (committed tokens per verify) {spec['tau']:.3f}, "
              f"outputs equal to plain greedy {same}/{n_prompts}", flush=True)
    result["seconds"] = round(time.time() - start, 1)
    return result
