"""One rank of the collectives check (tests/gpu/test_multi_gpu.py): started by llama.launch, one process
per GPU. Each check compares with values computed on the host, or (the bf16 model's eager steps) with the
captured step; a failure exits non-zero."""

import faulthandler
import sys

import numpy as np

from llama.cuda import BF16, Graph, empty, runtime, select_device, to_device
from llama.parallel.distributed import DistributedEnv
from llama.options import ZERO_STAGES as STAGES
from llama.parallel.zero import ShardLayout, Zero


def rank_values(rank: int, n: int, dtype) -> np.ndarray:
    return (np.random.default_rng(rank).standard_normal(n)).astype(dtype)


def eager_steps_match_captured(comm, stage: int) -> None:
    """The bf16 model's eager path (forward, backward per micro-batch, then optimizer_step) gives the bits of its
    captured train_step at this ZeRO stage: two steps of two micro-batches (the later one's reductions add to the
    shard at stages 2-3), different batches on each rank."""
    from llama.config import get_preset
    from llama.model.gpu_bf16 import GPUModelBF16
    from llama.optim import AdamWConfig
    from llama.params import init_parameters
    from llama.options import RunOptions
    from llama.plan import make_plan
    config = get_preset("tiny").replace(dim=256, n_heads=4, n_kv_heads=2, n_layers=3, vocab_size=512, multiple_of=64,
                                        max_seq_len=64)
    params, opt = init_parameters(config, 3).astype(BF16).astype(np.float32), AdamWConfig()
    plan = make_plan(config, RunOptions("cuda", "bf16", gpus=comm.world_size, zero=stage))
    captured, eager = (GPUModelBF16(config, 2, 64, params=params, comm=comm, plan=plan) for _ in range(2))
    rng = np.random.default_rng(comm.rank)
    batches = [(rng.integers(0, 512, (2, 64)), rng.integers(0, 512, (2, 64))) for _ in range(2)]
    for step in (1, 2):  # the second step replays the captured graphs
        captured.train_step(batches, 1e-3, step, opt)
        eager.zero_grad()
        for tokens, targets in batches:
            eager.forward(tokens, targets, loss_scale=0.5)
            eager.backward()
        eager.optimizer_step(1e-3, step, opt)
    a, b = captured.get_params(), eager.get_params()
    if comm.rank == 0:
        assert not np.array_equal(a, params), f"ZeRO-{stage}: the steps changed nothing"
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"ZeRO-{stage}: eager steps differ from train_step"


def main() -> int:
    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where it is
    env = DistributedEnv.from_environ()
    select_device(env.local_rank)
    from llama.parallel.nccl import Communicator
    world, rank = env.world_size, env.rank
    with Communicator(env, timeout=120) as comm:
        everyone = [rank_values(r, 4096 * world, np.float32) for r in range(world)]
        total = np.sum(everyone, axis=0, dtype=np.float64)

        x = to_device(everyone[rank])
        comm.fork(); comm.all_reduce(x); comm.join()
        assert np.allclose(x.download(), total, rtol=1e-5, atol=1e-5), "all_reduce sum"
        print(f"rank {rank}: all_reduce sum ok", flush=True)

        out = empty(4096)
        comm.fork(); comm.reduce_scatter(out, to_device(everyone[rank])); comm.join()
        mine = slice(rank * 4096, (rank + 1) * 4096)
        assert np.allclose(out.download(), total[mine] / world, rtol=1e-5, atol=1e-6), "reduce_scatter mean"
        print(f"rank {rank}: reduce_scatter mean ok", flush=True)

        piece = rank_values(10 + rank, 1000, BF16)
        gathered = empty(1000 * world, BF16)
        comm.fork(); comm.all_gather(gathered, to_device(piece)); comm.join()
        expected = np.concatenate([rank_values(10 + r, 1000, BF16) for r in range(world)])
        assert np.array_equal(gathered.download().view(np.uint16), expected.view(np.uint16)), "all_gather bf16"
        print(f"rank {rank}: all_gather bf16 ok", flush=True)

        assert np.allclose(comm.host_reduce([rank, 1.5]), [sum(range(world)), 1.5 * world]), "host_reduce sum"
        assert np.array_equal(comm.host_reduce([rank, -rank], "min"), [0, 1 - world]), "host_reduce min"
        print(f"rank {rank}: host_reduce ok", flush=True)

        # a captured fork / all-reduce / join replays with the values in place at replay time
        y = to_device(everyone[rank])
        graph = Graph(lambda: (comm.fork(), comm.all_reduce(y), comm.join()))
        for _ in range(2):
            y.upload(everyone[rank])
            graph.replay()
            assert np.allclose(y.download(), total, rtol=1e-5, atol=1e-5), "captured all_reduce"
        del graph  # NCCL releases the communicator only once its graphs are gone
        print(f"rank {rank}: captured all_reduce ok", flush=True)

        # Zero: the full array from every rank's shard, bucket by bucket, and (stage 3) each bucket into its home
        flat = rank_values(99, 50_000, np.float32)
        layout = ShardLayout(flat.size, world, [7_000, 20_003, 30_000, 41_000])
        for stage in STAGES:
            zero = Zero(layout, comm, flat, np.ones(flat.size, np.uint8), BF16, stage=stage)
            back = zero.gather(zero.master)
            if rank == 0:
                assert np.array_equal(back, flat), f"Zero.gather at stage {stage}"
            assert np.array_equal(zero.gather_flat(zero.master).download(), flat), f"Zero.gather_flat at stage {stage}"
            # what the gathers do not write stays NaN: the full weights (stages 1-2), the buckets' homes (stage 3)
            homes = zero.weight_homes
            for buffer in [zero.weights] if zero.weights is not None else [*homes.own.values(), *homes.slots]:
                buffer.upload(np.full(buffer.size, np.nan, BF16))
            zero.begin(gather=True)
            for k, (start, end) in enumerate(layout.spans):
                zero.use_weights(start, prefetch=layout.spans[k + 1][0] if k + 1 < len(layout.spans) else None)
                got = zero.weight(start, (end - start,)).download()
                zero.release_weights(start)
                assert np.array_equal(got.view(np.uint16), flat[start:end].astype(BF16).view(np.uint16)), \
                    f"bucket {k} at stage {stage}"
            zero.end(None)
            print(f"rank {rank}: Zero stage {stage} gathers ok", flush=True)
        for stage in STAGES:
            eager_steps_match_captured(comm, stage)
            print(f"rank {rank}: bf16 eager steps at ZeRO-{stage} ok", flush=True)
        runtime().synchronize()
    print(f"rank {rank}: collectives ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
