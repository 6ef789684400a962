"""One rank of a Rendezvous test (tests/system/test_distributed.py): python -m tests.rendezvous_rank RANK WORLD PORT MODE.

Prints the broadcast bytes in hex. MODE "broadcast" then closes; "watch" and "raise" watch rank 0,
print "watching", wait for stdin to close, print what on_lost received, then close cleanly ("watch")
or let an exception escape the `with` block ("raise")."""
import sys

from llama.parallel.distributed import DistributedEnv, DistributedError, Rendezvous

rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    with Rendezvous(DistributedEnv(rank, world, rank, "127.0.0.1", port), timeout=10) as rdv:
        print(rdv.broadcast(None).hex(), flush=True)
        if mode in ("watch", "raise"):
            lost = []
            rdv.watch(lost.append)
            print("watching", flush=True)
            sys.stdin.read()
            print(f"lost: {lost}", flush=True)
            if mode == "raise":
                raise RuntimeError("this rank failed")
except DistributedError as e:
    print(f"error: {e}", flush=True)
    sys.exit(1)
