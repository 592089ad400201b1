"""DSparkProposer: per-request feature caches (projected, windowed, fed through observe or requests),
greedy one-hot blocks (probs None), mixed temperatures, contract errors."""
import pytest
import torch

import k3compile
from k3compile.model_def.drafter import K3DSparkDrafter
from k3compile.model_def.drafter_config import DrafterConfig
from k3compile.runtime.spec.dspark_proposer import DSparkProposer
from k3compile.runtime.spec.proposer import DraftRequest

LAYERS = (2, 8)


@pytest.fixture(scope="module")
def pair():
    target = k3compile.load_model("k3-tiny", seed=2)
    cfg = DrafterConfig(vocab_size=512, hidden_size=64, target_num_layers=9, target_layer_ids=LAYERS,
                        mask_token_id=511, block_size=6, context_window=8)
    drafter = K3DSparkDrafter(cfg).bind(target)
    drafter.init_weights(seed=4)
    x = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))
    _, feats = target.train_forward(x, LAYERS)
    return drafter.eval(), x, feats


def direct(drafter, x, feats, row, upto, gamma):
    """What the proposer should compute for request `row` with features of positions < upto (anchor at upto)."""
    lo = max(0, upto - drafter.config.context_window)
    ctx = drafter.project_features(feats[row, lo:upto])[None]
    tokens, _, conf = drafter.draft(ctx, torch.arange(lo, upto)[None], torch.ones(1, 1, upto - lo, dtype=torch.bool),
                                    x[row, upto: upto + 1], torch.tensor([upto]), gamma, torch.tensor([0.0]))
    return tokens[0], conf[0]


def test_greedy_block_matches_the_drafter_with_windowed_context(pair):
    drafter, x, feats = pair
    p = DSparkProposer(drafter, gamma=4)
    assert p.feature_layers == LAYERS
    p.observe("a", x[0, :12].tolist(), feats[0, :12])
    p.observe("a", x[0, 12:20].tolist(), feats[0, 12:20])  # 20 rows seen, the window keeps 12..19
    block = p.propose([DraftRequest("a", x[0, :21].tolist(), 0.0),
                       DraftRequest("b", x[1, :6].tolist(), 0.0, features=feats[1, :5])])
    assert block.probs is None and block.tokens.shape == (2, 4)
    for i, (row, upto) in enumerate(((0, 20), (1, 5))):
        tokens, conf = direct(drafter, x, feats, row, upto, 4)
        assert block.tokens[i].tolist() == tokens.tolist()
        torch.testing.assert_close(block.confidence[i], conf)
    assert bool(((block.confidence > 0) & (block.confidence < 1)).all())


def test_mixed_temperatures_give_distributions(pair):
    drafter, x, feats = pair
    p = DSparkProposer(drafter, gamma=3, seed=1)
    block = p.propose([DraftRequest("a", x[0, :8].tolist(), 0.0, feats[0, :7]),
                       DraftRequest("b", x[1, :8].tolist(), 0.8, feats[1, :7])])
    assert block.probs.shape == (2, 3, 512)
    torch.testing.assert_close(block.probs.sum(-1), torch.ones(2, 3))
    assert torch.equal(block.probs[0].argmax(-1), block.tokens[0]) and bool((block.probs[0].max(-1).values == 1).all())
    assert bool((block.probs[1].gather(1, block.tokens[1][:, None]) > 0).all())


def test_contract_errors_and_release(pair):
    drafter, x, feats = pair
    p = DSparkProposer(drafter, gamma=2)
    with pytest.raises(ValueError, match="features for 9 positions"):
        p.propose([DraftRequest("a", x[0, :5].tolist(), 0.0, feats[0, :9])])
    p.release("a")
    p.propose([DraftRequest("a", x[0, :5].tolist(), 0.0, feats[0, :4])])  # a fresh cache after release
    with pytest.raises(ValueError, match="gamma"):
        DSparkProposer(drafter, gamma=7)
    with pytest.raises(ValueError, match="width"):
        p.observe("c", [1], torch.zeros(1, 5))
