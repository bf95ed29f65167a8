"""`--run-path`: run the training script through `runpy.run_path`, as torchrun does.

Owns: the worker-side shim behind --run-path. Writes torch's error-file format on an uncaught
exception so the agent's report shows the traceback (torchrun wraps this path in @record).
Must not import: torch, typer, rich.
"""

from __future__ import annotations

import runpy
import sys

from ftrun.worker.errorfile import write_error_file


def main() -> None:
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:
        write_error_file(exc)
        raise


if __name__ == "__main__":
    main()
