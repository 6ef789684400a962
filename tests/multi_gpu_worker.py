"""One rank of the collectives check, or with the argument init of the initialization check
(tests/gpu/test_multi_gpu.py): started by llama.launch, one process per GPU. Each check compares with values
computed on the host, or (the bf16 model's eager steps) with the captured step; a failure exits non-zero."""

import faulthandler
import sys

import numpy as np

from llama.runtime.cuda import BF16, Graph, empty, runtime, select_device, to_device
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
    from llama.run.plan import make_plan
    config = get_preset("tiny").replace(dim=256, n_heads=4, n_kv_heads=2, n_layers=3, vocab_size=512, multiple_of=64,
                                        max_seq_len=64)
    params, opt = init_parameters(config, 3).astype(BF16).astype(np.float32), AdamWConfig()
    plan = make_plan(config, RunOptions("cuda", "bf16", gpus=comm.world_size, zero=stage))
    captured, eager = (GPUModelBF16(config, plan, (2, 64), params=params, comm=comm) for _ in range(2))
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


def collectives(comm) -> None:
    """NCCL's collectives against host values, Zero's gathers at every stage, and the bf16 model's eager steps
    against its captured ones."""
    world, rank = comm.world_size, comm.rank
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


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def device_init_matches_host_init(comm, stage: int) -> None:
    """A model built without params draws its shard of the master weights on each GPU (Zero.fill_master): the bits
    of the same model built from init_parameters at this ZeRO stage, in the master shard (its padding included),
    the weights the forward reads (stages 1-2: the full bf16 or fp32 weights; stage 3: the bf16 shard, and the
    embedding's and head's homes that the next forward gathers) and the bf16 model's fp32 norm weights. The bf16
    model with fp32 moments, and with 8-bit ones (pieces of whole blocks: its last bucket padded); the fp32 model
    with dim 48 and vocab 97 (its embedding's bucket padded)."""
    from llama.config import get_preset
    from llama.model.gpu_bf16 import GPUModelBF16
    from llama.model.gpu_fp32 import GPUModelFP32
    from llama.options import RunOptions
    from llama.params import ParameterLayout, init_parameters
    from llama.run.plan import make_plan
    bf16_config = get_preset("tiny").replace(dim=256, n_heads=4, n_kv_heads=2, n_layers=3, vocab_size=512,
                                             multiple_of=64, max_seq_len=64)
    fp32_config = get_preset("tiny").replace(dim=48, n_heads=3, n_kv_heads=1)

    def bf16(optimizer: str):
        plan = make_plan(bf16_config, RunOptions("cuda", "bf16", optimizer=optimizer, gpus=comm.world_size, zero=stage))
        return lambda params: GPUModelBF16(bf16_config, plan, (2, 64), params=params, seed=5, comm=comm)

    def fp32(params):
        return GPUModelFP32(fp32_config, make_plan(fp32_config, RunOptions("cuda", "fp32", zero=stage)), (2, 32),
                            params=params, seed=5, comm=comm)

    models = {"bf16": (bf16_config, bf16("adamw"), False),
              "bf16 with 8-bit moments": (bf16_config, bf16("adamw8bit"), True), "fp32": (fp32_config, fp32, True)}
    for name, (config, build, padded) in models.items():
        expected = init_parameters(config, 5)
        drawn, uploaded = build(None), build(expected)
        z, host = drawn.zero, uploaded.zero
        assert (z.layout.padded_size > ParameterLayout(config).size) == padded, f"{name}: the padding"
        assert z.stale == host.stale == (z.weights is None), f"{name} at ZeRO-{stage}: the weights to gather"
        buffers = {"master": (z.master, host.master), "weights": (z.weights, host.weights),
                   "weight shard": (z.weight_shard, host.weight_shard)}
        if z.weights is None:  # stage 3: the embedding's and head's homes, gathered by the next forward's begin
            for zero in (z, host):
                zero.begin(gather=False)
                zero.end(None)
            buffers |= {f"home {k}": (z.weight_homes.own[k], host.weight_homes.own[k]) for k in z.weight_homes.own}
        if name != "fp32":
            buffers["norm weights"] = (drawn.norm_weights.values, uploaded.norm_weights.values)
        for what, (a, b) in buffers.items():
            if a is not None:
                assert same_bits(a.download(), b.download()), f"{name} at ZeRO-{stage}: the {what} differ"
        params = drawn.get_params()
        if comm.rank == 0:
            assert same_bits(params, expected), f"{name} at ZeRO-{stage}: the gathered master"


def main() -> int:
    """With the argument init, the initialization on each GPU at every ZeRO stage; without, the collectives."""
    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where it is
    env = DistributedEnv.from_environ()
    select_device(env.local_rank)
    from llama.parallel.nccl import Communicator
    check = "init" if sys.argv[1:] == ["init"] else "collectives"
    with Communicator(env, timeout=120) as comm:
        if check == "init":
            for stage in STAGES:
                device_init_matches_host_init(comm, stage)
                print(f"rank {env.rank}: device init at ZeRO-{stage} ok", flush=True)
        else:
            collectives(comm)
        runtime().synchronize()
    print(f"rank {env.rank}: {check} ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
