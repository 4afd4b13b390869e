import os, resource, threading, time, torch
def rss(): return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**30
def mark(w): print(f"{w}: rss {rss():.2f} GiB, peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/2**20:.2f}", flush=True)
from datasets import load_dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer
from transformers import AutoModelForCausalLM, AutoTokenizer
mark("imports")
path = "/work/runs/standin"
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mark("from_pretrained")
ds = load_dataset("json", data_files="/work/runs/standin-data/sft_train.jsonl", split="train").select(range(8))
args = SFTConfig(output_dir="/tmp/probe-out", max_steps=1, per_device_train_batch_size=2, max_length=1024,
                 activation_checkpointing=True, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True)
trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                     peft_config=LoraConfig(r=32, lora_alpha=64, target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]))
mark("SFTTrainer built")
import transformers
class Cb(transformers.TrainerCallback):
    def on_step_begin(self, *a, **k): mark("step begin")
    def on_step_end(self, *a, **k): mark("step end")
trainer.add_callback(Cb())
trainer.train()
mark("trained")
