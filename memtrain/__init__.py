"""memtrain: plan, compile and run memory-lean fine-tuning on DeepSpeed."""
__version__ = "0.1.0"
