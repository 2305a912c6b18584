"""The `memtrain` command and `python -m memtrain`.

Importing the command line imports torch, transformers and DeepSpeed (seconds on a cold machine). A Ctrl-C
then ends it as one later does: one line and the shell's 130, not an import traceback.
"""

import sys

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT


def main() -> None:
    try:
        from memtrain.cli import app  # inside the try: the import itself takes seconds a Ctrl-C may cut
    except KeyboardInterrupt:
        print("■ stopped by Ctrl-C while starting", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT_CODE)
    app()


if __name__ == "__main__":
    main()
