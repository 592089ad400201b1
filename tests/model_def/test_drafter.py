"""The DSpark block drafter: block attention structure, serial heads, shared target pieces, checkpoints."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

import k3compile
from k3compile.model_def.checkpoint_errors import CheckpointError
from k3compile.model_def.config import ConfigError
from k3compile.model_def.drafter import K3DSparkDrafter
from k3compile.model_def.drafter_checkpoint import load_drafter, save_drafter
from k3compile.model_def.drafter_config import DrafterConfig

G = 4


@pytest.fixture(scope="module")
def target():
    return k3compile.load_model("k3-tiny", seed=1)


def make(target, **kw):
    c = target.config
    cfg = DrafterConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, target_num_layers=c.num_hidden_layers,
                        target_layer_ids=(1, 5, 8), mask_token_id=511, block_size=G, **kw)
    d = K3DSparkDrafter(cfg).bind(target)
    d.init_weights(seed=7)
    with torch.no_grad():  # non-zero Markov bias so the serial head matters in the tests
        d.markov_proj.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    return d.eval()


def context(target, t=20, seed=0):
    x = torch.randint(0, 256, (1, t), generator=torch.Generator().manual_seed(seed))
    _, f = target.train_forward(x, (1, 5, 8))
    return x, f


def test_blocks_see_only_their_context_and_their_own_block(target):
    d = make(target)
    x, f = context(target)
    ctx = d.project_features(f)
    pos = torch.tensor([[6, 12]])
    j = torch.arange(20)
    visible = (j[None, None] < pos[..., None])
    h2 = d.block_hidden(ctx, j[None], visible, x[:, pos[0]], pos, G)
    h1 = d.block_hidden(ctx, j[None], visible[:, :1], x[:, pos[0, :1]], pos[:, :1], G)
    torch.testing.assert_close(h2[:, 0], h1[:, 0])  # block 0 ignores block 1
    ctx2 = ctx.clone()
    ctx2[:, 6:] += 1.0  # rows at or after block 0's anchor are invisible to it
    torch.testing.assert_close(d.block_hidden(ctx2, j[None], visible[:, :1], x[:, :1], pos[:, :1], G),
                               d.block_hidden(ctx, j[None], visible[:, :1], x[:, :1], pos[:, :1], G))
    assert not torch.allclose(d.block_hidden(ctx2, j[None], visible, x[:, pos[0]], pos, G)[:, 1], h2[:, 1])


def test_attention_inside_the_block_is_not_causal(target):
    """Changing the last block token's input changes the first position's output (not so in a causal model)."""
    d = make(target)
    x, f = context(target)
    ctx = d.project_features(f)
    j = torch.arange(20)
    args = (ctx, j[None], (j < 10)[None, None], x[:, 10:11], torch.tensor([[10]]), G)
    h = d.block_hidden(*args)
    other = K3DSparkDrafter(DrafterConfig(**{**d.config.__dict__, "mask_token_id": 300})).bind(target)
    other.load_state_dict(d.state_dict())
    h2 = other.block_hidden(*args)
    assert not torch.allclose(h[0, 0, 0], h2[0, 0, 0])


def test_greedy_draft_equals_teacher_forcing_on_its_own_tokens(target):
    d = make(target)
    x, f = context(target)
    ctx = d.project_features(f)
    j = torch.arange(20)
    vis = (j < 15)[None, None]
    tokens, probs, conf = d.draft(ctx, j[None], vis, x[:, 15], torch.tensor([15]), G, torch.tensor([0.0]))
    prev = torch.cat([x[:, 15:16], tokens[:, :-1]], 1)[:, None]
    logits, c_logits = d.teacher_forced(ctx, j[None], vis, x[:, 15:16], torch.tensor([[15]]), prev, G)
    assert tokens.tolist() == logits.argmax(-1)[:, 0].tolist()
    torch.testing.assert_close(conf, torch.sigmoid(c_logits[:, 0]))
    assert torch.equal(probs.argmax(-1), tokens) and torch.equal(probs.sum(-1), torch.ones(1, G))
    # the Markov head makes position k depend on token k-1: a different anchor changes position 0's logits
    other, _ = d.markov(torch.tensor([x[0, 15].item() + 1]))
    assert not torch.allclose(other, d.markov(x[:, 15])[0])


def test_sampled_draft_probs_are_the_tempered_distribution(target):
    d = make(target)
    x, f = context(target)
    ctx, j = d.project_features(f), torch.arange(20)
    gen = torch.Generator().manual_seed(0)
    tokens, probs, _ = d.draft(ctx, j[None], (j < 15)[None, None], x[:, 15], torch.tensor([15]), G,
                               torch.tensor([0.7]), gen)
    prev = torch.cat([x[:, 15:16], tokens[:, :-1]], 1)[:, None]
    logits, _ = d.teacher_forced(ctx, j[None], (j < 15)[None, None], x[:, 15:16], torch.tensor([[15]]), prev, G)
    torch.testing.assert_close(probs, torch.softmax(logits[:, 0] / 0.7, -1))


def test_checkpoint_round_trip_and_no_shared_tensors(target, tmp_path):
    d = make(target)
    save_drafter(d, str(tmp_path))
    from safetensors import safe_open
    names = list(safe_open(str(tmp_path / "model.safetensors"), "pt").keys())
    assert not [n for n in names if "embed_tokens" in n or "lm_head" in n]
    loaded = load_drafter(str(tmp_path), target)
    for (n, a), (_, b) in zip(sorted(d.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), n
    assert json.load(open(tmp_path / "config.json"))["model_type"] == "k3_dspark_drafter"


def test_bad_checkpoints_are_refused(target, tmp_path):
    d = make(target)
    save_drafter(d, str(tmp_path))
    sd = {k: v.clone() for k, v in d.state_dict().items()}
    weights = str(tmp_path / "model.safetensors")
    save_file({**sd, "lm_head.weight": target.lm_head.weight.clone()}, weights)
    with pytest.raises(CheckpointError, match="carries 'lm_head.weight'"):
        load_drafter(str(tmp_path), target)
    save_file({k: v for k, v in sd.items() if k != "fc.weight"}, weights)
    with pytest.raises(CheckpointError, match="missing tensor"):
        load_drafter(str(tmp_path), target)
    save_file({**sd, "fc.weight": torch.zeros(3, 3)}, weights)
    with pytest.raises(CheckpointError, match="fc.weight.*shape"):
        load_drafter(str(tmp_path), target)
    os.remove(weights)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_drafter(str(tmp_path), target)
    with pytest.raises(ConfigError, match="no config.json"):
        load_drafter(str(tmp_path / "nope"), target)
    json.dump(target.config.to_hf_dict(), open(tmp_path / "config.json", "w"))  # a target, not a drafter
    with pytest.raises(ConfigError, match="expected 'k3_dspark_drafter'"):
        load_drafter(str(tmp_path), target)


def test_drafter_and_target_must_agree(target, tmp_path):
    d = make(target)
    save_drafter(d, str(tmp_path))
    other = k3compile.load_model("kimi-linear-tiny")
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_drafter(str(tmp_path), other)
    with pytest.raises(ConfigError, match="out of range"):
        DrafterConfig(vocab_size=512, hidden_size=64, target_num_layers=9, target_layer_ids=(9,), mask_token_id=1)
    with pytest.raises(ValueError, match="gamma"):
        x, f = context(target)
        d.block_hidden(d.project_features(f), torch.arange(20)[None], torch.ones(1, 1, 20, dtype=torch.bool),
                       x[:, :1], torch.tensor([[0]]), G + 1)
