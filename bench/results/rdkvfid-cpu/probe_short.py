import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiered_radix.adapters.transformers.session import generate
from tiered_radix.models.paths import model_dir

torch.set_num_threads(1)
d = model_dir("smollm2-135m")  # the offline export
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
pols = [a for a in sys.argv[1:] if a.endswith(".yaml") or a in ("rdkv", "full", "qevict")]
prompts = [
    "The capital of France is",
    "What is the capital of Japan? Answer in one word.",
    "Water boils at sea level at a temperature of how many degrees Celsius?",
    "Who wrote the play Romeo and Juliet?",
]
for p in prompts:
    for pol in ["full"] + pols:
        t = time.time()
        text, turn = generate(model, tok, p, pol, max_new_tokens=12)
        print(
            f"{pol:40s} {turn.bytes_used / turn.full_bytes:.3f} {time.time() - t:.1f}s {text!r}",
            flush=True,
        )
