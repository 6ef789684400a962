"""A rank for tests/system/test_launch.py: python tests/launch_child.py MODE FOLDER [ARGS...].

env:  write what the launcher set, and the arguments that reached us, to FOLDER/env<RANK>.
fail: write FOLDER/pid<RANK>; rank 1 exits 3 at once, rank 0 sleeps (ignoring SIGTERM if ARGS is "stubborn").
term: on SIGTERM and SIGINT append the signal's name to FOLDER/term<RANK> and exit 128 + its number
      (on the second signal if ARGS is "twice"); FOLDER/ready<RANK> (holding the pid) says the handlers are in place.
peer: write FOLDER/ready<RANK> (holding the pid); rank 0 exits 1 as soon as rank 1 is gone (as a rank whose peer's
      connection closed does), rank 1 sleeps.
"""
import os
import signal
import sys
import time

mode, folder, *rest = sys.argv[1:]
rank = os.environ["RANK"]


def write(name: str, text: str) -> None:
    with open(os.path.join(folder, name + ".tmp"), "w") as f:
        f.write(text)
    os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))


if mode == "env":
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NCCL_NVLS_ENABLE"]
    write(f"env{rank}", "\n".join([*(f"{n}={os.environ.get(n)}" for n in names), f"ARGS={' '.join(rest)}"]))
elif mode == "fail":
    write(f"pid{rank}", str(os.getpid()))
    if rank == "1":
        sys.exit(3)
    if rest == ["stubborn"]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
elif mode == "term":
    def on_signal(signum, frame):
        with open(os.path.join(folder, f"term{rank}"), "a") as f:
            f.write(signal.Signals(signum).name + "\n")
        if rest != ["twice"] or len(open(os.path.join(folder, f"term{rank}")).readlines()) == 2:
            sys.exit(128 + signum)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    write(f"ready{rank}", str(os.getpid()))
    time.sleep(60)
elif mode == "peer":
    write(f"ready{rank}", str(os.getpid()))
    if rank == "0":
        while not os.path.exists(os.path.join(folder, "ready1")):
            time.sleep(0.01)
        peer = int(open(os.path.join(folder, "ready1")).read())
        while open(f"/proc/{peer}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":  # until rank 1 is dead
            time.sleep(0.01)
        sys.exit(1)
    time.sleep(60)
