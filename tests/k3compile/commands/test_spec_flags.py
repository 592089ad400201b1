"""The speculative-decoding flags of serve / generate: parsed into EngineArgs fields, bad combinations refused."""
import pytest

from k3compile.cli import build_parser
from k3compile.commands.spec_flags import spec_kwargs
from k3compile.model_def.config import ConfigError


def _args(*flags):
    return build_parser().parse_args(["serve", "k3-tiny", *flags])


def test_flags_become_engine_args():
    kw = spec_kwargs(_args("--speculative", "ngram", "--num-speculative-tokens", "3", "--spec-window", "snapshot"))
    assert kw == dict(speculative="ngram", draft=None, num_speculative_tokens=3, spec_window="snapshot",
                      spec_plan="all", spec_profile=None)
    assert spec_kwargs(_args()) == {}
    gen = build_parser().parse_args(["generate", "--model", "k3-tiny", "--prompt", "x", "--speculative", "dspark",
                                     "--draft", "d"])
    assert spec_kwargs(gen)["draft"] == "d"


@pytest.mark.parametrize("flags,message", [
    (("--speculative", "dspark"), "needs --draft"),
    (("--draft", "d"), "needs --speculative"),
    (("--speculative", "ngram", "--spec-plan", "trim"), "needs --spec-profile"),
])
def test_bad_combinations_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        spec_kwargs(_args(*flags))
