"""One SFT step of plain TRL `SFTTrainer` on the rehearsal's stand-in (the stage's own dataset, first two examples,
and SFTConfig), counting the tensors it holds: every tensor storage created during `trainer.train()` is counted from
its creation until it is freed (a TorchDispatchMode and a weakref finalizer per storage); the weights and buffers
that exist before are not. Prints the peak of those live bytes, what was alive near it by op and shape, and peak RSS
beside it. Run in a copy of the rehearsal's scratch directory (params.yaml, models/base, data/prepared, configs/):

    PYTHONPATH=src python probe_live_tensors.py                                    # the recipe (checkpointing on)
    MALLOC_MMAP_THRESHOLD_=65536 PYTHONPATH=src python probe_live_tensors.py       # glibc's threshold fixed
    NO_CHECKPOINTING=1 MALLOC_MMAP_THRESHOLD_=65536 PYTHONPATH=src python probe_live_tensors.py
    # under DeepSpeed, two processes (the accelerate configs of the repository):
    MALLOC_MMAP_THRESHOLD_=131072 PYTHONPATH=src python -m accelerate.commands.launch \
        --config_file configs/accelerate/zero2.yaml --num_processes 2 probe_live_tensors.py
    STEPS=2 MALLOC_MMAP_THRESHOLD_=131072 PYTHONPATH=src python -m accelerate.commands.launch \
        --config_file configs/accelerate/zero3.yaml --num_processes 2 probe_live_tensors.py

Output on file in probe_results.txt; agentrl.benchmarks.memory_plan's activation terms come from it.
"""

import collections
import math
import os
import resource
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from trl import SFTTrainer

from agentrl.config import load_params
from agentrl.modeling import load_model, load_tokenizer
from agentrl.stages import sft, training


class LiveTensors(TorchDispatchMode):
    """Bytes of the tensor storages created inside the mode and not yet freed; their peak, and what was alive near
    it (refreshed every 50 MB of growth)."""

    def __init__(self, known: set):
        super().__init__()
        self.known, self.alive, self.now, self.peak, self.at_peak, self.snapped = known, {}, 0, 0, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.alive or key in self.known or storage.nbytes() == 0:
                continue  # a view of a counted storage, a weight, or nothing
            self.alive[key] = (storage.nbytes(), func.overloadpacket.__name__, tuple(t.shape))
            self.now += storage.nbytes()
            weakref.finalize(storage, self.free, key)
            self.peak = max(self.peak, self.now)
            if self.now > self.snapped + 50e6:
                self.snapped, self.at_peak = self.now, list(self.alive.values())
        return out

    def free(self, key):
        if key in self.alive:
            self.now -= self.alive.pop(key)[0]


def mark(where: str) -> None:
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"PROBE rank {os.environ.get('RANK', 0)} {where}: rss {rss:.2f} GiB, peak {peak:.2f}", flush=True)


params = load_params()
# the TRL config first, as the stage builds it: under ZeRO-3 (zero3_init_flag) the model then loads partitioned
args, _ = training.start(params, "sft", sft.sft_config)
args.max_steps = int(os.environ.get("STEPS", 1))  # 2: DeepSpeed ZeRO-3 has traced a step
if os.environ.get("NO_CHECKPOINTING"):
    args.activation_checkpointing = args.gradient_checkpointing = False
tok = load_tokenizer("models/base")
tok.padding_side = "right"
model = load_model("models/base", dtype=torch.float32)
data = sft.dataset(tok, params).select(range(2))
print("lengths", [len(ids) for ids in data["input_ids"]], flush=True)
trainer = SFTTrainer(
    model=model, args=args, train_dataset=data, processing_class=tok, peft_config=training.peft_config(params, "sft")
)
for p in trainer.model.parameters():  # touch every weight: the memory-mapped ones count in RSS from here on
    p.data.sum()
mark("before step")
start = time.time()
weights = list(trainer.model.parameters()) + list(trainer.model.buffers())
counter = LiveTensors({w.untyped_storage().data_ptr() for w in weights})
with counter:
    trainer.train()
mark(f"after step ({time.time() - start:.0f} s)")
rank = os.environ.get("RANK", 0)
print(f"rank {rank} PEAK live new tensors {counter.peak / 2**30:.3f} GiB; still alive {counter.now / 2**30:.3f}")
by_kind = collections.Counter()
for nbytes, op, shape in counter.at_peak:
    by_kind[(op, shape)] += nbytes
for (op, shape), nbytes in by_kind.most_common(40):
    print(f"  {nbytes / 2**20:9.1f} MiB {op} {shape} x{round(nbytes / (4 * math.prod(shape)))}")
