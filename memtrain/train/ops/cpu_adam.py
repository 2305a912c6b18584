"""DeepSpeed's CPU Adam op, loaded while the rest of the run starts.

An optimizer offloaded to the CPU steps with DeepSpeed's CPU Adam, a C++ op built on first use (33 s on the GPU
machine) and loaded on every start (2.4 s there, nearly all of it py-cpuinfo: DeepSpeed's op builder asks it for the
CPU's architecture and vector width, and DeepSpeedCPUAdam asks again; each answer is a fresh Python subprocess,
1.2 s). Neither the build nor the load needs the model, so `CpuAdamLoad.start` begins them in a thread as soon as
the process is set up, while the data and the model are built, and `wait` joins it before deepspeed.initialize,
which finds the op loaded. A failed build is said there, with the ways around it.

`share_cpu_info` answers every get_cpu_info() of this process with its first answer: the CPU does not change
while a run starts.
"""

from __future__ import annotations

import threading

from memtrain.recipe.schema import Recipe
from memtrain.train.ops.deepspeed_ops import CPU_ADAM, needs_cpu_adam, op_failure


def share_cpu_info() -> None:
    """Make py-cpuinfo's get_cpu_info() ask once per process (DeepSpeed imports it by name at each call, so
    the shared function is the one it gets). Safe to call more than once and from several threads."""
    import cpuinfo  # noqa: PLC0415 — DeepSpeed's dependency; only runs that load CPU Adam need it

    if getattr(cpuinfo.get_cpu_info, "shared_by_memtrain", False):
        return
    ask, lock, answers = cpuinfo.get_cpu_info, threading.Lock(), []

    def get_cpu_info() -> dict:
        with lock:
            if not answers:
                answers.append(ask())
        return dict(answers[0])

    get_cpu_info.shared_by_memtrain = True
    cpuinfo.get_cpu_info = get_cpu_info


class CpuAdamLoad:
    """DeepSpeed's CPU Adam op, built or loaded in a background thread (nothing for recipes that do not use it)."""

    def __init__(self, recipe: Recipe):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._wanted = needs_cpu_adam(recipe)

    def start(self) -> CpuAdamLoad:
        if not self._wanted or self._thread is not None:
            return self
        # imported here, in the calling thread: the loading thread then imports only the op itself
        import torch.utils.cpp_extension  # noqa: F401, PLC0415 — heavy; the op builder's own import
        from deepspeed.ops.op_builder import CPUAdamBuilder  # noqa: PLC0415 — DeepSpeed caches the loaded op

        share_cpu_info()

        def load() -> None:
            try:
                CPUAdamBuilder().load()
            except BaseException as error:  # noqa: BLE001 — handed to wait(), which raises it in the run's thread
                self._error = error

        self._thread = threading.Thread(target=load, name="memtrain-cpu-adam", daemon=True)
        self._thread.start()
        return self

    def wait(self) -> None:
        """Block until the op is loaded. A build or load that failed is a UserError naming the way around it (the
        machine's compiler, or PyTorch's AdamW); anything else it raised is raised as it was."""
        if self._thread is None:
            self.start()
        if self._thread is not None:
            self._thread.join()
        if self._error is None:
            return
        error, self._error = self._error, None
        if not isinstance(error, Exception):
            raise error
        raise op_failure(CPU_ADAM, error) from error
