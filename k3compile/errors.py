"""Errors that are the user's input, not our bug: the CLI prints them as one line."""
from __future__ import annotations

from k3compile.model_def.checkpoint_errors import CheckpointError
from k3compile.model_def.config import ConfigError
from k3compile.report.trace import TraceError

UserError = (ConfigError, CheckpointError, FileNotFoundError, TraceError)


def check_device(name: str) -> None:
    """--device names a device this torch can use, else one ConfigError line (not a torch traceback)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"--device {name}: not a device name ({e})") from None
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise ConfigError(f"--device {name}: this torch ({torch.__version__}) is built without CUDA; "
                              f"install a CUDA build of torch or use --device cpu")
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: torch has CUDA but sees no GPU (check CUDA_VISIBLE_DEVICES / the driver)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) visible")
    elif device.type not in ("cpu", "meta"):
        raise ConfigError(f"--device {name}: k3compile runs on cpu or cuda")
