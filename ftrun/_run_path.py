"""`--run-path`: run the training script through `runpy.run_path`, as torchrun does.

Owns: the worker-side shim behind --run-path. Writes torch's error-file format on an uncaught
exception so the agent's report shows the traceback (torchrun wraps this path in @record).
Must not import: torch, typer, rich.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback


def main() -> None:
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if path:
            with open(path, "w") as f:
                json.dump({"message": {"message": f"{type(exc).__name__}: {exc}",
                                       "extraInfo": {"py_callstack": traceback.format_exc(),
                                                     "timestamp": str(int(time.time()))}}}, f)
        raise


if __name__ == "__main__":
    main()
