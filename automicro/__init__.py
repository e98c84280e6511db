"""automicro: OOM-safe `device_train_microbatch_size: auto` for MosaicML Composer on FSDP2."""

__version__ = "0.1.0"

from automicro.integration.callback import AutoMicrobatching, MicrobatchSizeError  # noqa: E402
from automicro.integration.trainer import Trainer  # noqa: E402

__all__ = ["AutoMicrobatching", "MicrobatchSizeError", "Trainer", "__version__"]
