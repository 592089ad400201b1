"""Lossless verification: greedy reproduces greedy decoding; rejection sampling's committed tokens are
distributed exactly as the target's (chi-square over whole 3-token continuations, fixed seed), with
full draft distributions and with one-hot drafts; a deliberately wrong verifier fails the same test."""
import pytest
import torch

from k3compile.runtime.spec.acceptance import PAD, verify, verify_greedy, verify_sampled

V, GAMMA, LENGTH, ROWS = 5, 3, 3, 60000


def chain(seed, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=g) * sharp, -1)  # [prev, next]


TARGET, DRAFT = chain(1), chain(2, sharp=2.0)


def speculate(verifier, one_hot: bool, seed=0):
    """ROWS independent generations of LENGTH tokens after anchor 0, by speculative steps of GAMMA drafts
    from the DRAFT chain verified against the TARGET chain. Returns [ROWS, LENGTH] tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((ROWS, LENGTH + GAMMA + 1), PAD, dtype=torch.long)
    have = torch.zeros(ROWS, dtype=torch.long)
    last = torch.zeros(ROWS, dtype=torch.long)
    rows = torch.arange(ROWS)
    while bool((have < LENGTH).any()):
        drafts, dprobs, prev = [], [], last
        for _ in range(GAMMA):
            q = DRAFT[prev]
            tok = q.argmax(-1) if one_hot else torch.multinomial(q, 1, generator=gen)[:, 0]
            drafts.append(tok)
            dprobs.append(q)
            prev = tok
        d = torch.stack(drafts, 1)
        ctx = torch.cat([last[:, None], d], 1)  # target distribution after each of anchor, d_1..d_gamma
        res = verifier(d, None if one_hot else torch.stack(dprobs, 1), TARGET[ctx], gen)
        for j in range(GAMMA + 1):
            take = (j < res.num_tokens) & (have + j < out.shape[1])
            out[rows[take], (have + j)[take]] = res.tokens[take, j]
        have = have + res.num_tokens
        last = res.tokens.gather(1, res.accepted[:, None])[:, 0]
    return out[:, :LENGTH]


def chi_square_pvalue(samples):
    idx = (samples * torch.tensor([V * V, V, 1])).sum(1)
    observed = torch.bincount(idx, minlength=V ** 3).double()
    grid = torch.cartesian_prod(*[torch.arange(V)] * 3)
    exact = TARGET[0][grid[:, 0]] * TARGET[grid[:, 0], grid[:, 1]] * TARGET[grid[:, 1], grid[:, 2]]
    expected = exact.double() * samples.shape[0]
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(V ** 3 - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def sampled_verifier(d, dp, tp, gen):
    return verify_sampled(d, dp, tp, generator=gen)


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_matches_target_distribution(one_hot):
    samples = speculate(sampled_verifier, one_hot)
    assert chi_square_pvalue(samples) > 1e-3


def test_wrong_verifier_is_caught():
    """Accepting every draft commits the draft's distribution: the same test must reject it."""
    def accept_all(d, dp, tp, gen):
        res = verify_sampled(d, dp, tp, generator=gen)
        bonus = torch.multinomial(tp[:, -1], 1, generator=gen)
        return type(res)(torch.full_like(res.accepted, d.shape[1]), torch.cat([d, bonus], 1))
    assert chi_square_pvalue(speculate(accept_all, one_hot=False)) < 1e-6


def test_identical_draft_is_always_accepted():
    g = torch.Generator().manual_seed(0)
    tp = torch.softmax(torch.randn(64, GAMMA + 1, V, generator=g), -1)
    d = torch.multinomial(tp[:, :GAMMA].reshape(-1, V), 1, generator=g).view(64, GAMMA)
    res = verify_sampled(d, tp[:, :GAMMA], tp, generator=g)
    assert bool((res.accepted == GAMMA).all())


def test_greedy_reproduces_greedy_decoding():
    """Greedy speculation with random drafts commits exactly the target chain's greedy path."""
    greedy_path, tok = [], 0
    for _ in range(12):
        tok = int(TARGET[tok].argmax())
        greedy_path.append(tok)
    g = torch.Generator().manual_seed(3)
    out, last = [], 0
    while len(out) < 12:
        d = torch.randint(0, V, (1, GAMMA), generator=g)
        d[0, 0] = TARGET[last].argmax()  # the first draft right, the rest random
        ctx = torch.cat([torch.tensor([[last]]), d], 1)
        res = verify_greedy(d, TARGET[ctx].log())
        row = res.rows()[0]
        assert len(row) == res.accepted.item() + 1 >= 2
        out += row
        last = row[-1]
    assert out[:12] == greedy_path


def test_num_draft_trims_and_mixed_batch():
    tp = torch.zeros(3, GAMMA + 1, V)
    tp[..., 1] = 1.0  # the target always says 1
    d = torch.ones(3, GAMMA, dtype=torch.long)
    res = verify(d, None, tp, greedy=torch.tensor([True, False, True]), num_draft=torch.tensor([3, 1, 0]))
    assert res.accepted.tolist() == [3, 1, 0]
    assert res.rows() == [[1, 1, 1, 1], [1, 1], [1]]
    assert res.tokens[2, 1:].tolist() == [PAD] * GAMMA


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="gamma \\+ 1"):
        verify_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, V))
    with pytest.raises(ValueError, match="num_draft"):
        verify_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, V), torch.tensor([4, 0]))
