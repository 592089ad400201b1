"""Temperature > 0 through the SpecDecoder: rejection sampling against the sampler's own distribution
(temperature + top-k) keeps the output distribution exactly the target's. 600 requests of one prompt,
3 new tokens each, drafts from a proposer whose distribution differs from the target's (so drafts are
accepted, rejected and resampled from the residual); chi-square of the 3-token continuations against
the exact joint distribution from the plain model, fixed seeds (half the requests seeded: the CPU
per-request path, half the shared batched draw)."""
import pytest
import torch

from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.sampler import sampling_probs
from k3compile.runtime.sampling import SamplingParams
from k3compile.runtime.spec.proposer import DraftBlock
from tests.runtime.engine_helpers import check_idle

PROMPT = [5, 17, 99, 3, 250, 42, 7]
PARAMS = dict(temperature=1.0, top_k=3, max_new_tokens=3, ignore_eos=True)
N = 600


class Distorted:
    """Drafts from q = 0.7 on the least likely token the target keeps + 0.2 p_t + 0.1 over the raw top 5 (two of
    them outside top-k: always rejected): drafts are accepted often and rejected often, and a rejection must
    resample from the residual max(0, p_t - q), not from p_t, or the least likely token comes out too often."""
    feature_layers = ()

    def __init__(self, model, gamma=2):
        self.model, self.gamma = model, gamma
        self.gen = torch.Generator().manual_seed(1)
        self._q: dict[tuple, torch.Tensor] = {}

    def q(self, prefix):
        key = tuple(prefix)
        if key not in self._q:
            logits = self.model(torch.tensor([prefix]))[0, -1]
            p = sampling_probs(logits[None], [SamplingParams(**PARAMS)])[0]
            u = torch.zeros_like(p).index_fill_(0, logits.topk(5).indices, 0.1 / 5)
            rare = torch.where(p > 0, p, 2.0).argmin()
            self._q[key] = 0.2 * p + u + 0.7 * torch.nn.functional.one_hot(rare, p.shape[0])
        return self._q[key]

    def propose(self, requests):
        v = self.model.config.vocab_size
        tokens = torch.zeros(len(requests), self.gamma, dtype=torch.long)
        probs = torch.zeros(len(requests), self.gamma, v)
        for i, r in enumerate(requests):
            prefix = list(r.token_ids)
            for k in range(self.gamma):
                q = self.q(prefix)
                tokens[i, k] = int(torch.multinomial(q, 1, generator=self.gen))
                probs[i, k] = q
                prefix.append(int(tokens[i, k]))
        return DraftBlock(tokens, probs, torch.full((len(requests), self.gamma), 0.5))

    def observe(self, rid, token_ids, features, start=None):
        pass

    def release(self, rid):
        pass


def exact_joint(model):
    """{(t1, t2, t3): probability} of the non-speculative sampler."""
    params = SamplingParams(**PARAMS)
    def p(prefix):
        return sampling_probs(model(torch.tensor([prefix]))[0, -1][None], [params])[0]
    out = {}
    p1 = p(PROMPT)
    for a in p1.nonzero()[:, 0].tolist():
        p2 = p(PROMPT + [a])
        for b in p2.nonzero()[:, 0].tolist():
            p3 = p(PROMPT + [a, b])
            for c in p3.nonzero()[:, 0].tolist():
                out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return out


@pytest.mark.parametrize("window", ["replay", "snapshot"])
def test_sampled_output_has_the_target_distribution(model, window):
    torch.manual_seed(0)
    engine = LLMEngine(EngineArgs(memory_bytes=1 << 23, page_size=16, chunk_size=32, spec_window=window,
                                  max_running=128), model=model, proposer=Distorted(model))
    params = [SamplingParams(**PARAMS, seed=i if i % 2 else None) for i in range(N)]
    got = engine.generate([PROMPT] * N, params)
    s = engine.spec.stats
    assert 0 < s.accepted < s.verified, s  # drafts were both accepted and rejected
    exact = exact_joint(model)
    counts: dict[tuple, int] = {}
    for g in got:
        counts[tuple(g)] = counts.get(tuple(g), 0) + 1
    assert set(counts) <= set(exact), set(counts) - set(exact)  # never outside top-k
    cells = torch.tensor([[counts.get(k, 0), N * v] for k, v in exact.items()], dtype=torch.float64)
    stat = ((cells[:, 0] - cells[:, 1]) ** 2 / cells[:, 1]).sum()
    df = torch.tensor(len(exact) - 1.0, dtype=torch.float64)
    pvalue = float(torch.special.gammaincc(df / 2, stat / 2))
    assert pvalue > 1e-3, (pvalue, stat, len(exact))
    check_idle(engine)


def test_seeded_requests_reproduce(model):
    def run():
        engine = LLMEngine(EngineArgs(memory_bytes=1 << 22, page_size=16, chunk_size=32), model=model,
                           proposer=Distorted(model))
        return engine.generate([PROMPT] * 4, [SamplingParams(**PARAMS, seed=10 + i) for i in range(4)])
    assert run() == run()
