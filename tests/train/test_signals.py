"""torchrun's own log lines around memtrain's: a broken exit barrier after a finished run is not a traceback."""
from __future__ import annotations

import io
import logging

from memtrain.train.signals import EXIT_BARRIER_LOGGER, QuietExitBarrier


def test_a_broken_exit_barrier_after_a_finished_run_is_one_warning_line_not_a_traceback():
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.agent.server import api  # the logger torchrun's agent writes with

    assert api.logger.name == EXIT_BARRIER_LOGGER
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    quiet = QuietExitBarrier()
    api.logger.addHandler(handler)
    api.logger.addFilter(quiet)
    try:
        try:  # what api.SimpleElasticAgent._exit_barrier logs when node 0's agent has closed the store
            raise DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
        except DistNetworkError:
            api.logger.exception("Error waiting on exit barrier. Elapsed: %s seconds", 0.3)
        api.logger.error("Some other error %s", 7)  # other records pass unchanged
    finally:
        api.logger.removeFilter(quiet)
        api.logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines == ["WARNING the nodes' exit barrier broke (node 0 left first); every worker had finished, so "
                     "nothing is lost", "ERROR Some other error 7"], lines
