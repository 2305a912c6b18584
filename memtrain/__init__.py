"""memtrain: plan, compile and run memory-lean fine-tuning on DeepSpeed."""

import logging
import warnings

__version__ = "0.1.0"

# bitsandbytes (which PEFT imports) asks the Hugging Face hub for a CPU 4-bit matmul kernel on CPUs with AVX512-BF16
# and, when it cannot have one (offline, or an untrusted repository), logs a warning on every run and plan; its own
# kernel serves instead, so the line only alarms. Errors still show.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

# DeepSpeed's ZeRO calls torch.distributed.all_gather_into_tensor, which PyTorch 2.14 deprecates with a FutureWarning
# printed by every process of a multi-GPU run; nothing a user of memtrain can act on.
warnings.filterwarnings(
    "ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated", category=FutureWarning
)
