"""One SFT step of plain TRL `SFTTrainer` on the rehearsal's stand-in, with the SFT stage's own dataset (its first 8
examples) and SFTConfig (agentrl.stages.sft.dataset / sft_config, from the params.yaml of the working directory),
RSS marked at each point: what one step takes at the recipe's sequence lengths, without the rest of the stage.
Run in a copy of the rehearsal's scratch directory (params.yaml, models/base, data/prepared, configs/, src/):

    PYTHONPATH=src python probe_trl_sft.py                     # activation checkpointing on (the recipe)
    NO_CHECKPOINTING=1 PYTHONPATH=src python probe_trl_sft.py  # off

Output of both on file in probe_results.txt.
"""

import os
import resource

import torch
import transformers
from trl import SFTTrainer

from agentrl.config import load_params
from agentrl.modeling import load_model, load_tokenizer
from agentrl.stages import sft, training


def mark(where: str) -> None:
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{where}: rss {rss:.2f} GiB, peak {peak:.2f}", flush=True)


class Marks(transformers.TrainerCallback):
    def on_step_begin(self, *args, **kwargs):
        mark("step begin")

    def on_step_end(self, *args, **kwargs):
        mark("step end")


mark("imports")
params = load_params()
tok = load_tokenizer("models/base")
tok.padding_side = "right"
model = load_model("models/base", dtype=torch.float32)
mark("model loaded")
data = sft.dataset(tok, params).select(range(8))
print("lengths", [len(ids) for ids in data["input_ids"]])
args, _ = training.start(params, "sft", sft.sft_config)
args.max_steps = 1
if os.environ.get("NO_CHECKPOINTING"):
    args.activation_checkpointing = args.gradient_checkpointing = False
trainer = SFTTrainer(
    model=model,
    args=args,
    train_dataset=data,
    processing_class=tok,
    peft_config=training.peft_config(params, "sft"),
    callbacks=[Marks()],
)
mark("SFTTrainer built")
trainer.train()
mark("trained")
