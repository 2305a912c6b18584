"""Per-GPU calibration constants of the memory model, stored beside each profile in configs/gpus.

They describe the card and the software stack, never a recipe: the CUDA context outside PyTorch's
allocator, the allocator's reserved-over-allocated slack, how many reduce buckets DeepSpeed keeps
alive while overlapping communication, and the host process's baseline. A size such as '24GiB'
instead of a profile gets the defaults below. The accuracy harness (scripts/plan_accuracy.py)
measures them on a real card; the keys are documented in docs/PLAN.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from memtrain.configs import CONFIGS_DIR, gpu_profile
from memtrain.errors import Problem, UserError
from memtrain.units import GiB, parse_bytes


@dataclass(frozen=True)
class Calibration:
    name: str
    capacity_bytes: int
    # defaults (used for a card given only by size) = the H200 calibration of 2026-12-02 (docs/BENCHMARKS.md)
    cuda_context_bytes: int = int(0.6 * GiB)
    # peak reserved = peak allocated × (1 + ratio), by what churns through the allocator
    # (memtrain.plan.planner.allocation_pattern); fitted on the H200 matrix of 2026-12-02
    allocator_slack_ratios: tuple[tuple[str, float], ...] = (
        ("full", 0.28),
        ("frozen", 0.05),
        ("quantized", 0.15),
        ("zero3", 0.5),
    )
    # the largest slack seen per pattern on the H200 (full: 1.1B at micro-batch 16, 0.58): the plan's
    # "tight" warning and `micro_batch: auto` use it, so a fit at the expected slack is not taken for sure
    allocator_slack_ratios_high: tuple[tuple[str, float], ...] = (
        ("full", 0.58),
        ("frozen", 0.06),
        ("quantized", 0.16),
        ("zero3", 0.55),
    )
    # the same with expandable segments (hardware.expandable_segments, the default), fitted on the H200
    # matrix of 2026-12-02 (benchmarks/plan_accuracy.csv): freed memory is reused whatever the sizes
    # (full 0.005-0.06, LoRA 0.02-0.03, QLoRA 0.083-0.109).
    # (ZeRO-3: its compute stream only, see below)
    expandable_slack_ratios: tuple[tuple[str, float], ...] = (
        ("full", 0.03),
        ("frozen", 0.02),
        ("quantized", 0.09),
        ("zero3", 0.06),
    )
    expandable_slack_ratios_high: tuple[tuple[str, float], ...] = (
        ("full", 0.08),
        ("frozen", 0.04),
        ("quantized", 0.11),
        ("zero3", 0.10),
    )
    expandable_init_slack_ratio: float = 0.06  # 1.1B 6.65 / 6.15 GiB, 3B 19.95 / 19.15 GiB
    # ...except across CUDA streams: ZeRO-3 gathers parameters and reduces large gradients on streams of
    # its own, whose segments keep their own high-water marks; their few large blocks leave little unused
    # (1.1B: 3 % and 22 % on 2.0 and 0.28 GiB of gathered parameters, 3 % on the reduce stream's 0.61).
    # Its compute stream keeps at least this many loss-sized tensors (tokens of a loss chunk × vocabulary,
    # fp32) unused: 1.1B and 3B 160 and 143 MiB beside a 125 MiB one (benchmarks/segments/*.json, H200,
    # 2026-12-03), whatever their activations (0.77 and 1.70 GiB).
    expandable_side_stream_slack_ratio: float = 0.03
    expandable_side_stream_slack_ratio_high: float = 0.05
    expandable_zero3_min_slack_loss_tensors: float = 1.2
    zero_bucket_factor: float = 4.5  # live reduce buckets with overlap_comm (1 without)
    host_baseline_bytes: int = int(2.2 * GiB)  # torch + DeepSpeed + tokenizer + loader, before model states
    # Page-locked memory costs the machine more than its bytes: measured machine-wide (MemTotal - MemAvailable),
    # runs with pinned buffers used 2.3-2.9 % of those buffers beyond every other host term (3B ZeRO-3 offload
    # +0.98 GiB on 38.6 pinned; layer inputs on the host: Llama-3-8B at 64k +0.38 on 15.5, Qwen2.5-7B at 32k
    # +0.20 on 7.0 and at 4k +0.08 on 3.5; benchmarks/host_memory), where runs without them were within their plan
    host_pinned_overhead_ratio: float = 0.03
    init_slack_ratio: float = 0.07  # reserved over allocated while deepspeed.initialize builds flat buffers
    # deepspeed.initialize under ZeRO-1/2 holds this many extra compute-dtype copies of the trainable
    # parameters beside the module (its flat buffer and the copy it is built from). The H200 anchors
    # (1.1B: 6.90 GiB, 3B: 20.1 GiB peak reserved, ZeRO-2 optimizer offload) both give 2.
    zero_init_flat_copies: float = 2.0
    pcie_gbps: float = 25.0

    def slack_ratio(self, pattern: str, expandable: bool = False) -> float:
        """Reserved-over-allocated slack at the peak for an allocation pattern (full, frozen, quantized,
        zero3), with expandable segments or PyTorch's default caching of fixed blocks."""
        return dict(self.expandable_slack_ratios if expandable else self.allocator_slack_ratios)[pattern]

    def slack_ratio_high(self, pattern: str, expandable: bool = False) -> float:
        """The largest slack measured for the pattern (never below the expected one)."""
        high = self.expandable_slack_ratios_high if expandable else self.allocator_slack_ratios_high
        return max(self.slack_ratio(pattern, expandable), dict(high)[pattern])

    def init_slack(self, expandable: bool = False) -> float:
        """Reserved over allocated while deepspeed.initialize builds its flat buffers."""
        return self.expandable_init_slack_ratio if expandable else self.init_slack_ratio


def calibration(gpu: str) -> Calibration:
    """The calibration of a GPU profile name or an anonymous size ('24GiB'). Raises ValueError for neither,
    and UserError naming the file and key for a profile value that is not a number."""
    profile = gpu_profile(gpu)
    raw: dict = {}
    path = CONFIGS_DIR / "gpus" / f"{gpu}.yaml"
    if path.is_file():
        raw = yaml.safe_load(path.read_text()) or {}
    defaults = Calibration(name=profile.name, capacity_bytes=profile.memory_bytes)

    def value(key: str, default, convert=float):
        try:
            return convert(raw[key]) if key in raw else default
        except (TypeError, ValueError):
            raise UserError(
                Problem(
                    f"{raw[key]!r} is not a number",
                    key=key,
                    file=str(path),
                    hint="a number (a ratio) or a size such as 0.6GiB; docs/PLAN.md lists the keys",
                )
            ) from None

    def ratios(key: str, default):
        return value(key, default, lambda raw_value: _slack_ratios(raw_value, default))

    return Calibration(
        name=profile.name,
        capacity_bytes=profile.memory_bytes,
        cuda_context_bytes=profile.cuda_context_bytes,
        allocator_slack_ratios=ratios("allocator_slack_ratio", defaults.allocator_slack_ratios),
        allocator_slack_ratios_high=ratios("allocator_slack_ratio_high", defaults.allocator_slack_ratios_high),
        expandable_slack_ratios=ratios("expandable_slack_ratio", defaults.expandable_slack_ratios),
        expandable_slack_ratios_high=ratios("expandable_slack_ratio_high", defaults.expandable_slack_ratios_high),
        expandable_init_slack_ratio=value("expandable_init_slack_ratio", defaults.expandable_init_slack_ratio),
        expandable_side_stream_slack_ratio=value(
            "expandable_side_stream_slack_ratio", defaults.expandable_side_stream_slack_ratio
        ),
        expandable_side_stream_slack_ratio_high=value(
            "expandable_side_stream_slack_ratio_high", defaults.expandable_side_stream_slack_ratio_high
        ),
        expandable_zero3_min_slack_loss_tensors=value(
            "expandable_zero3_min_slack_loss_tensors", defaults.expandable_zero3_min_slack_loss_tensors
        ),
        zero_bucket_factor=value("zero_bucket_factor", defaults.zero_bucket_factor),
        host_baseline_bytes=value("host_baseline", defaults.host_baseline_bytes, parse_bytes),
        host_pinned_overhead_ratio=value("host_pinned_overhead_ratio", defaults.host_pinned_overhead_ratio),
        zero_init_flat_copies=value("zero_init_flat_copies", defaults.zero_init_flat_copies),
        init_slack_ratio=value("init_slack_ratio", defaults.init_slack_ratio),
        pcie_gbps=float(profile.pcie_gbps or defaults.pcie_gbps),
    )


def _slack_ratios(raw, defaults: tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
    """A profile's allocator_slack_ratio: one number for every pattern, or a mapping pattern -> ratio."""
    if raw is None:
        return defaults
    if isinstance(raw, dict):
        return tuple((name, float(raw.get(name, value))) for name, value in defaults)
    return tuple((name, float(raw)) for name, _ in defaults)
