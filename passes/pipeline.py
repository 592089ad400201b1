"""Which passes run, in what order, with which options: `PipelineConfig`, from defaults, a file, flags.

Precedence, lowest first: registry defaults (every registered pass, in name order, default
options) < config file < `--passes` < `--enable-pass` / `--disable-pass` < `--pass-opt`.

Config file: TOML (`.toml`) or JSON (`.json`), same structure:

    order = ["p01_gemm_merge", "p02_noop_views", "p03_casts_copies_dce", "p04_fused_routing"]

    [passes.p01_gemm_merge]        # any field of the pass's config dataclass
    min_group = 3

    [passes.p04_fused_routing]
    enabled = false

`order` is optional (default: all passes in name order); passes left out of it do not run. Names
may be unique prefixes (`p01`). Unknown passes, unknown options and wrongly typed values are
errors that name the culprit.

Flags (`add_pass_arguments` adds them to an argparse parser; `pipeline_from_args` reads them):

    --pass-config FILE                 the file above
    --passes p01,p02 | all | none      run exactly these, in this order
    --disable-pass p04[,p03]           repeatable
    --enable-pass p04                  repeatable
    --pass-opt p01_gemm_merge.min_group=2   repeatable; `true/false` for flags, `none` for optional
"""
from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field

from .registry import PassConfig, PassConfigError, get_pass, registered_passes, resolve_pass_name


@dataclass
class PipelineConfig:
    order: list[str] = field(default_factory=list)  # passes to run, in order
    configs: dict[str, PassConfig] = field(default_factory=dict)  # per pass (every name in `order`)

    @classmethod
    def default(cls) -> "PipelineConfig":
        passes = registered_passes()
        return cls(order=list(passes), configs={n: s.default_config() for n, s in passes.items()})

    def config(self, name: str) -> PassConfig:
        if name not in self.configs:
            self.configs[name] = get_pass(name).default_config()
        return self.configs[name]

    def enabled_passes(self) -> list[str]:
        return [n for n in self.order if self.config(n).enabled]

    def validate(self) -> None:
        seen = set()
        for name in self.order:
            get_pass(name)
            if name in seen:
                raise PassConfigError(f"pass {name!r} appears twice in the pipeline order")
            seen.add(name)
            self.config(name).validate()
        # P5's decode kernel and P16's verify inputs (which the ReplaySSM fold follows) take one KDA launch
        # layout: the state after speculation is bit-identical to P5's decode only with the same blocks
        kda = [self.config(n) for n in ("p05_fused_kda_decode", "p16_kda_verify_inputs") if n in self.enabled_passes()]
        if len(kda) == 2 and kda[0].launch != kda[1].launch:
            raise PassConfigError(f"p05_fused_kda_decode.launch = {kda[0].launch!r} but p16_kda_verify_inputs.launch "
                                  f"= {kda[1].launch!r}: they must name one layout")

    def to_dict(self) -> dict:
        """JSON-serializable; `from_dict(to_dict())` gives the same pipeline."""
        return {"order": list(self.order),
                "passes": {n: dataclasses.asdict(self.config(n)) for n in self.order}}

    @classmethod
    def from_dict(cls, data: dict, base: "PipelineConfig | None" = None, source: str = "pipeline config"):
        if not isinstance(data, dict):
            raise PassConfigError(f"{source}: expected a table/object at the top level")
        unknown = set(data) - {"order", "passes"}
        if unknown:
            raise PassConfigError(f"{source}: unknown key(s) {sorted(unknown)}; expected 'order' and 'passes'")
        cfg = base.copy() if base is not None else cls.default()
        if "order" in data:
            order = data["order"]
            if not isinstance(order, list) or not all(isinstance(n, str) for n in order):
                raise PassConfigError(f"{source}: 'order' must be a list of pass names")
            cfg.order = [resolve_pass_name(n) for n in order]
        passes = data.get("passes", {})
        if not isinstance(passes, dict):
            raise PassConfigError(f"{source}: 'passes' must map pass names to option tables")
        for raw_name, opts in passes.items():
            name = resolve_pass_name(raw_name)
            if not isinstance(opts, dict):
                raise PassConfigError(f"{source}: options of pass {name!r} must be a table/object")
            for key, value in opts.items():
                cfg.set_option(name, key, value, source=source)
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str, base: "PipelineConfig | None" = None) -> "PipelineConfig":
        if not os.path.isfile(path):
            raise FileNotFoundError(f"pass config file not found: {path}")
        try:
            if path.endswith(".json"):
                with open(path) as f:
                    data = json.load(f)
            elif path.endswith(".toml"):
                with open(path, "rb") as f:
                    data = tomllib.load(f)
            else:
                raise PassConfigError(f"{path}: pass config must be a .toml or .json file")
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
            raise PassConfigError(f"{path}: cannot parse pass config: {e}") from None
        return cls.from_dict(data, base, source=path)

    def copy(self) -> "PipelineConfig":
        return PipelineConfig(list(self.order), {n: dataclasses.replace(c) for n, c in self.configs.items()})

    def set_option(self, name: str, key: str, value, source: str = "--pass-opt") -> None:
        cfg = self.config(name)
        fields = {f.name: f for f in dataclasses.fields(cfg)}
        if key not in fields:
            raise PassConfigError(f"{source}: pass {name!r} has no option {key!r}; options: {', '.join(fields)}")
        hint = typing.get_type_hints(type(cfg))[key]
        setattr(cfg, key, _coerce(value, hint, f"{source}: {name}.{key}"))


def _coerce(value, hint, where: str):
    """Check (or parse, for strings from flags) a value against a field's type annotation."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() == "none")):
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise PassConfigError(f"{where}: unsupported option type {hint}")
        return _coerce(value, inner[0], where)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise PassConfigError(f"{where}: expected true/false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            _bad(where, "a number", value)
        if isinstance(value, int) or (hint is float and isinstance(value, float)):
            return hint(value)
        if isinstance(value, str):
            try:
                return hint(value)
            except ValueError:
                pass
        _bad(where, "an integer" if hint is int else "a number", value)
    if hint is str:
        return value if isinstance(value, str) else _bad(where, "a string", value)
    raise PassConfigError(f"{where}: unsupported option type {hint}")


def _bad(where: str, what: str, value):
    raise PassConfigError(f"{where}: expected {what}, got {value!r}")


def _split_names(values) -> list[str]:
    out = []
    for v in values or ():
        out += [p for p in (s.strip() for s in v.split(",")) if p]
    return out


def pipeline_from_flags(passes: str | None = None, disable=(), enable=(), pass_opts=(),
                        config_file: str | None = None) -> PipelineConfig:
    """Build the pipeline the way `k3compile build` flags describe it (see the module doc)."""
    cfg = PipelineConfig.default()
    if config_file:
        cfg = PipelineConfig.from_file(config_file, cfg)
    if passes is not None:
        spec = passes.strip().lower()
        if spec == "all":
            cfg.order = list(registered_passes())
        elif spec in ("none", ""):
            cfg.order = []
        else:
            cfg.order = [resolve_pass_name(n) for n in _split_names([passes])]
        for name in cfg.order:
            cfg.config(name).enabled = True
    for name in _split_names(enable):
        name = resolve_pass_name(name)
        if name not in cfg.order:  # joins before the first pass that sorts after it
            cfg.order.insert(next((i for i, n in enumerate(cfg.order) if n > name), len(cfg.order)), name)
        cfg.config(name).enabled = True
    for name in _split_names(disable):
        cfg.config(resolve_pass_name(name)).enabled = False
    for opt in pass_opts or ():
        set_pass_option(cfg, opt)
    cfg.validate()
    return cfg


def set_pass_option(cfg: PipelineConfig, opt: str, source: str = "--pass-opt") -> None:
    """Set one `PASS.OPTION=VALUE` (a pass name prefix is enough) on cfg; `source` names the flag in errors."""
    target, sep, value = opt.partition("=")
    name, dot, key = target.strip().partition(".")
    if not sep or not dot or not key:
        raise PassConfigError(f"{source} {opt!r} is not PASS.OPT=VALUE: expected PASS.OPTION=VALUE, "
                              "e.g. p01_gemm_merge.min_group=2")
    cfg.set_option(resolve_pass_name(name), key.strip(), value.strip(), source=source)


def add_pass_arguments(parser) -> None:
    """Add the pipeline flags to an argparse parser (for `k3compile build`)."""
    g = parser.add_argument_group("passes")
    g.add_argument("--pass-config", metavar="FILE", help="pipeline config (.toml or .json): order and per-pass options")
    g.add_argument("--passes", metavar="LIST", help="run exactly these passes in this order (comma list, 'all', 'none')")
    g.add_argument("--disable-pass", action="append", default=[], metavar="NAME", help="skip a pass (repeatable)")
    g.add_argument("--enable-pass", action="append", default=[], metavar="NAME", help="run a pass (repeatable)")
    g.add_argument("--pass-opt", action="append", default=[], metavar="PASS.OPT=VALUE",
                   help="set a pass option, e.g. p01_gemm_merge.min_group=2 (repeatable)")


def pipeline_from_args(args) -> PipelineConfig:
    """PipelineConfig from an argparse namespace filled by `add_pass_arguments`."""
    return pipeline_from_flags(getattr(args, "passes", None), getattr(args, "disable_pass", ()),
                               getattr(args, "enable_pass", ()), getattr(args, "pass_opt", ()),
                               getattr(args, "pass_config", None))
