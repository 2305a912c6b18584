"""memtrain: plan, compile and run memory-lean fine-tuning on DeepSpeed."""
import logging

__version__ = "0.1.0"

# bitsandbytes (which PEFT imports) asks the Hugging Face hub for a CPU 4-bit matmul kernel on CPUs with AVX512-BF16
# and, when it cannot have one (offline, or an untrusted repository), logs a warning on every run and plan; its own
# kernel serves instead, so the line only alarms. Errors still show.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
