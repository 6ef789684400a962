"""Where a decode step's time goes: each launch of one step, repeated inside a CUDA graph and timed
alone, next to the whole step's graph; per launch the microseconds and the bytes read per second.

    python3 dev/cuda/decode_step.py --preset llama3.2-1b --batch 1 [--prompt 128] [--ordinary-launches]

Freshly initialized weights (llama.params.init_parameters); the step's launches are recorded from one eager
step (kernel, grid, arguments) and each is replayed REPEATS times in a graph of its own (the position is
restored after each, since the step's last launch advances it; the cache is long enough for the positions
the loops advance).
"""

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from llama.runtime import cuda  # noqa: E402
from llama.runtime.cli import require  # noqa: E402
from llama.config import get_preset  # noqa: E402
from llama.runtime.cuda import Graph, time_ms, to_device  # noqa: E402
from llama.model.sampling import Sampling  # noqa: E402
from llama.model.gpu_decoder import GPUDecoder  # noqa: E402
from llama.options import RunOptions  # noqa: E402
from llama.run.plan import make_plan  # noqa: E402
from llama.params import init_parameters  # noqa: E402

REPEATS = 20


def record_step(decoder, sampling) -> list:
    """(kernel, grid, block, args, kwargs) of every launch of one decode step, which runs as well."""
    launches, launch = [], cuda.Kernel.__call__

    def recording(kernel, grid, block, *args, **kwargs):
        launches.append((kernel, grid, block, args, kwargs))
        launch(kernel, grid, block, *args, **kwargs)
    cuda.Kernel.__call__ = recording
    try:
        decoder._decode_step(sampling)
    finally:
        cuda.Kernel.__call__ = launch
    return launches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--ordinary-launches", action="store_true")
    args = parser.parse_args()
    require("dev/cuda/decode_step.py", gpu=True)
    cuda.DEPENDENT_LAUNCHES["on"] = not args.ordinary_launches
    max_len = args.prompt + 8192  # room for the positions the timing loops advance
    config = get_preset(args.preset).replace(max_seq_len=max_len)
    params = to_device(init_parameters(config))
    decoder = GPUDecoder(config, make_plan(config, RunOptions("cuda")), params, batch=args.batch, max_len=max_len)
    greedy = Sampling(temperature=0)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (args.batch, args.prompt))
    decoder.prefill(tokens, greedy)
    decoder.decode(2, greedy)  # compiles, captures the step's graph
    position = decoder.position_d.download()
    step_ms = time_ms(lambda: decoder.graph[1].replay(), repeats=5, inner=10)
    decoder.position_d.upload(position)
    launches = record_step(decoder, greedy)
    decoder.position_d.upload(position)
    totals = defaultdict(lambda: [0, 0.0])
    print(f"{cuda.runtime().name}, {args.preset}, batch {args.batch}, cache {args.prompt}: "
          f"{len(launches)} launches; the step's graph {1e3 * step_ms:.1f} us")
    for kernel, grid, block, launch_args, kwargs in launches:
        graph = Graph(lambda: [kernel(grid, block, *launch_args, **kwargs) for _ in range(REPEATS)])
        us = 1e3 * time_ms(graph.replay, repeats=10, inner=5) / REPEATS
        decoder.position_d.upload(position)
        totals[kernel.name][0] += 1
        totals[kernel.name][1] += us
    print(f"{'kernel':<28}{'launches':>9}{'us each':>9}{'us total':>10}")
    for entry, (count, us) in sorted(totals.items(), key=lambda item: -item[1][1]):
        print(f"{entry:<28}{count:>9}{us / count:>9.2f}{us:>10.1f}")
    print(f"{'sum of launches alone':<46}{sum(us for _, us in totals.values()):>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
