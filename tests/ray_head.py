"""`python tests/ray_head.py start --head ...`: Ray's own `ray start`, with the node's Python
workers forked from zygotes that have imported torch (tests/zygote.py), for the heads of
tests/head.py. The zygotes' sockets lie in the head's `--temp-dir`, so the processes that
mention that folder are this head's."""

import sys

import zygote  # this file's folder is first on the path

if __name__ == "__main__":
    from ray.scripts.scripts import main

    temp = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--temp-dir=")), None)
    if temp is None or not zygote.enabled():
        sys.argv[0] = "ray"
        sys.exit(main())
    servers, paths = zygote.start(temp)
    sys.argv = ["ray", *sys.argv[1:]]
    try:
        with zygote.workers_from(paths):
            main()  # exits
    finally:
        for server in servers:
            server.kill()
