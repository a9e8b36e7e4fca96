"""Runs vLLM's own benchmark client (``vllm bench serve``) many times in one process.

Started with the serving environment's Python (it imports only vLLM and the standard
library). Each stdin line is ``{"argv": [...], "log": PATH}``: the argv of ``vllm bench serve``,
parsed by vLLM's own parser and run by its own ``main``; the run's output goes to ``log``.
Each answer on stdout is ``{"ok": true}`` or ``{"ok": false, "error": "..."}``. Importing vLLM
once instead of once per load point saves ~15 s a run on a small machine.
"""

import contextlib
import json
import sys
import traceback


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    answers = sys.stdout
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        with open(request["log"], "a") as log, contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):
            try:
                bench_main(parser.parse_args(request["argv"]))
                answer = {"ok": True}
            except (Exception, SystemExit) as err:  # report, keep serving the next request
                traceback.print_exc()
                answer = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        print(json.dumps(answer), file=answers, flush=True)


if __name__ == "__main__":
    main()
