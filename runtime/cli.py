"""``rlcore-run``: parse the config, print it, run the job. With no arguments: the built-in CPU demo job."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from runtime.config import ConfigError, format_config, parse_args
from runtime.errors import JobError
from runtime.hooks import HookError
from runtime.rollout.data import DataError

# Exit status of a job that could not start because of its inputs (argparse uses 2 for bad flags too).
EXIT_BAD_INPUT = 2
# Exit status of a job that started and stopped for a reason the user must fix (runtime.errors.JobError).
EXIT_JOB_STOPPED = 1


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
    except ConfigError as err:
        print(f"rlcore-run: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_config(cfg), flush=True)

    import transformers

    from runtime.loop import run

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        result = run(cfg, progress=sys.stdout.isatty())
    except (ConfigError, DataError, HookError) as err:
        print(f"rlcore-run: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except JobError as err:
        print(f"rlcore-run: {err}", file=sys.stderr)
        return EXIT_JOB_STOPPED
    print(f"rlcore-run: done, {result.final_step} steps; outputs in {result.output_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
