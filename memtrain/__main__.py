"""The `memtrain` command and `python -m memtrain`.

Importing the command line imports torch, transformers and DeepSpeed (seconds on a cold machine). A Ctrl-C
then ends it as one later does: one line and the shell's 130, not an import traceback. Once a command has said how
it ended, a Ctrl-C (or SIGTERM) during the interpreter's teardown ends the process at once with that command's code:
it would otherwise land in an atexit callback (torch's, DeepSpeed's, logging's) and print a KeyboardInterrupt
traceback after the clean line (a third Ctrl-C after "stop" and "abort the save").
"""

import os
import signal
import sys

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT


def main() -> None:
    try:
        from memtrain.cli import app  # inside the try: the import itself takes seconds a Ctrl-C may cut
    except KeyboardInterrupt:
        print("■ stopped by Ctrl-C while starting", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT_CODE)
    try:
        app()
    except SystemExit as done:  # typer ends every command so, with its exit code
        leave_at_once_on_a_stop(done.code if isinstance(done.code, int) else (0 if done.code is None else 1))
        raise


def leave_at_once_on_a_stop(code: int) -> None:
    """From now on SIGINT and SIGTERM end this process at once with `code`, its output flushed."""

    def leave(signum, frame):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed already, or a broken pipe: nothing more can be said
                pass
        os._exit(code)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, leave)


if __name__ == "__main__":
    main()
