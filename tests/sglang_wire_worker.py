"""Processes spawned by tests/test_sglang_wire.py.

`python tests/sglang_wire_worker.py sglang-engine ADDR PORT WORLD RANK GROUP OUT`: an SGLang engine rank as
its weight updater joins a weight-update group (SGLang's own `init_custom_process_group`, init_method
tcp://ADDR:PORT, as sglang/srt/model_executor/model_runner_components/weight_updater.py calls it), then
receives one bucket the way it does for load_format "flattened_bucket" (`FlattenedTensorBucket.empty` + one
broadcast) with the names/dtypes/shapes in OUT.json, and saves the reconstructed tensors to OUT.pt.

`python tests/sglang_wire_worker.py trainer-rank RANK WORLD STORE_PORT ENGINE_URL SEED`: trainer rank RANK of
a gloo world (default group over a TCPStore) that syncs the same full weights to one TP-2 engine through
WeightSync ipc; prints its pid.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def sglang_engine(addr: str, port: str, world: str, rank: str, group: str, out: str) -> None:
    import torch

    import sglang_reference as ref

    common, tb = ref.common(), ref.tensor_bucket()
    pg = common.init_custom_process_group(backend="gloo", init_method=f"tcp://{addr}:{port}", world_size=int(world),
                                          rank=int(rank), group_name=group)
    with open(out + ".json") as f:
        spec = json.load(f)
    bucket = tb.FlattenedTensorBucket.empty(spec["names"], spec["dtypes"], spec["shapes"], "cpu")
    torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
    torch.save({n: t.clone() for n, t in bucket.reconstruct_tensors()}, out + ".pt")
    torch.distributed.destroy_process_group(pg)


def trainer_rank(rank: str, world: str, store_port: str, engine_url: str, seed: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from slime.backends.megatron.weight_sync import EngineEndpoint, PayloadExchange, WeightSync
    from slime.utils.distributed import default_store

    rank_i, world_i = int(rank), int(world)
    store = dist.TCPStore("127.0.0.1", int(store_port), world_i, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank_i, world_size=world_i)
    g = torch.Generator().manual_seed(int(seed))
    weights = [("w.weight", torch.randn(8, 6, generator=g)), ("b.bias", torch.randn(4, generator=g).bfloat16())]
    engine = EngineEndpoint(engine_url, tp_size=2, trainer_ranks=[0, 1])
    ws = WeightSync("ipc", lambda: iter([weights]), [engine], rank_i, check=False, world_size=world_i,
                    exchange=PayloadExchange(default_store(), rank_i, 120))
    print("pid", os.getpid(), flush=True)
    ws.sync(version=1)
    print("synced", flush=True)
    dist.barrier()
    ws.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"sglang-engine": sglang_engine, "trainer-rank": trainer_rank}[sys.argv[1]](*sys.argv[2:])
