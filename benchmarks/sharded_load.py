"""What one FSDP2 learner's model load costs: read whole then sharded, against each learner reading its rows.

Each learner of a distributed run builds the model on the meta device, shards it and reads only its own
rows of every weight (`models.load_model(shard=...)`, `actors.load_sharded`). This starts N learner
processes (gloo, one thread each) twice per round: once loading the model whole and sharding it
afterwards (how learners loaded before), once as they load now, and reports per learner the load's
wall time, the peak of its private memory above what it held before the load (RssAnon, sampled every
2 ms), the peak of its whole resident set above the same point (VmHWM, which also counts the pages of
the weight file it had mapped: page cache, not memory of its own) and the FP32 parameters it holds.

    python benchmarks/sharded_load.py MODEL_DIR [--learners 2] [--rounds 1]

Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from parity.engines import kernels

WAYS = ("whole-then-sharded", "own-rows")


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _learner(rank: int, world: int, model_dir: str, way: str, folder: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from parity.distributed.actors import load_sharded
    from parity.engines.models.io import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    anon_start, resident_start, anon_peak, done = _status_mb("RssAnon"), _status_mb("VmHWM"), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            anon_peak[0] = max(anon_peak[0], _status_mb("RssAnon"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    if way == "whole-then-sharded":
        model = load_model(model_dir, kernels.numerics())
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = load_sharded(Path(model_dir), mesh, kernels.numerics(), "fp32")
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    dist.barrier()
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20
    result = {
        "learner": rank,
        "way": way,
        "seconds": round(seconds, 3),
        "private_peak_mb": round(anon_peak[0] - anon_start, 1),
        "resident_peak_mb": round(_status_mb("VmHWM") - resident_start, 1),
        "fp32_parameters_held_mb": round(held, 1),
    }
    (folder / f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps({"model": args.model_dir, "learners": args.learners, **kernels.numerics("cpu").describe()}))
    context = mp.get_context("spawn")
    for _ in range(args.rounds):
        for way in WAYS:
            with tempfile.TemporaryDirectory() as folder:
                learners = [
                    context.Process(target=_learner, args=(r, args.learners, args.model_dir, way, Path(folder)))
                    for r in range(args.learners)
                ]
                for p in learners:
                    p.start()
                for p in learners:
                    p.join()
                if any(p.exitcode for p in learners):
                    raise SystemExit(f"a learner failed ({way}); see its traceback above")
                for r in range(args.learners):
                    print((Path(folder) / f"{r}.json").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
