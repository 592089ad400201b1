"""Config of the DSpark block drafter (spec §5.2) and its config.json I/O.

The drafter reads the target's features (see model.py FEATURES) of `target_layer_ids`, and shares the
target's embedding and LM head, so its width is the target's hidden size and a drafter checkpoint is
only valid next to a target with the same vocabulary, width and layer count (checked on load).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .config import ConfigError, read_config_json

MODEL_TYPE = "k3_dspark_drafter"


@dataclass(frozen=True)
class DrafterConfig:
    vocab_size: int
    hidden_size: int  # = the target's hidden size (shared embedding and LM head)
    target_num_layers: int
    target_layer_ids: tuple[int, ...]  # target layers whose features the drafter attends to
    mask_token_id: int  # fills block positions 1..gamma-1 (its embedding is the target's row)
    block_size: int = 8  # the most tokens one forward proposes (gamma <= block_size)
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    head_dim: int = 16
    intermediate_size: int = 256
    markov_rank: int = 32  # low-rank transition bias W2 W1[x_{k-1}] (DSpark's sequential head)
    confidence_with_markov: bool = True  # confidence head input [h_k ; W1[x_{k-1}]] instead of h_k
    context_window: int = 256  # most recent target positions each block attends to
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        self.validate()

    @property
    def feature_size(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def validate(self) -> None:
        def need(cond, msg):
            if not cond:
                raise ConfigError(f"drafter config: {msg}")

        for f in ("vocab_size", "hidden_size", "target_num_layers", "block_size", "num_hidden_layers",
                  "num_attention_heads", "head_dim", "intermediate_size", "markov_rank", "context_window"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f"{f} must be a positive integer, "
                 f"got {getattr(self, f)!r}")
        need(len(self.target_layer_ids) > 0, "target_layer_ids must name at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.target_num_layers]
        need(not bad, f"target_layer_ids {bad} out of range for a target of {self.target_num_layers} layers")
        need(len(set(self.target_layer_ids)) == len(self.target_layer_ids), "target_layer_ids has duplicates")
        need(0 <= self.mask_token_id < self.vocab_size,
             f"mask_token_id {self.mask_token_id} outside the vocabulary (0..{self.vocab_size - 1})")
        need(self.head_dim % 2 == 0, f"head_dim must be even (rotary embedding), got {self.head_dim}")

    def check_target(self, target_cfg) -> None:
        """The drafter shares the target's embedding / LM head and reads its layers: shapes must agree."""
        for mine, theirs in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                             ("target_num_layers", "num_hidden_layers")):
            if getattr(self, mine) != getattr(target_cfg, theirs):
                raise ConfigError(f"drafter was built for a target with {theirs} = {getattr(self, mine)}, but the "
                                  f"target '{target_cfg.name}' has {getattr(target_cfg, theirs)}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return {"model_type": MODEL_TYPE, "architectures": ["K3DSparkDrafter"], **d}

    @classmethod
    def from_dict(cls, raw: dict, name: str = "drafter") -> "DrafterConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{name}: config.json must hold a JSON object")
        if raw.get("model_type") != MODEL_TYPE:
            raise ConfigError(f"{name}: model_type is {raw.get('model_type')!r}, expected '{MODEL_TYPE}' "
                              f"(is this a target checkpoint rather than a drafter?)")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
        missing = [n for n in required if raw.get(n) is None]
        if missing:
            raise ConfigError(f"{name}: drafter config.json is missing field(s): {', '.join(missing)}")
        return cls(**{k: v for k, v in raw.items() if k in fields})


def load_drafter_config(path: str) -> DrafterConfig:
    return DrafterConfig.from_dict(read_config_json(path, "drafter checkpoint"),
                                   name=os.path.basename(os.path.normpath(path)))
