import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiered_radix.adapters.transformers.session import generate
from tiered_radix.models.paths import model_dir

torch.set_num_threads(1)
d = model_dir("smollm2-135m")
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
pols = sys.argv[1:]
P = "Paris is the capital and largest city of France. With an estimated population of over two million residents, it is the centre of the Paris metropolitan area. Since the 17th century, Paris has been one of the world's major centres of finance, diplomacy, commerce, culture, fashion and gastronomy. The city is known for its museums and architectural landmarks: the Louvre received 8.9 million visitors in 2023, making it the most-visited art museum in the world. The Eiffel Tower, built for the 1889 World's Fair, is its best-known monument. The Seine river flows through the city, and its banks are lined with bookstalls. Paris hosted the Summer Olympic Games in 1900, 1924 and 2024. "  # noqa: E501
prompts = [
    P + "Question: Which river flows through Paris?",
    P * 2 + "Question: In which year was the Eiffel Tower built?",
    "The Amazon is the largest rainforest on Earth. " * 3
    + "The Nile is a long river in Africa. " * 3
    + "Mount Everest is the highest mountain in the world. " * 3
    + "Question: What is the highest mountain in the world?",
]
for p in prompts:
    ref = None
    for pol in ["full"] + pols:
        t = time.time()
        text, turn = generate(model, tok, p, pol, max_new_tokens=12)
        ref = turn.ids if ref is None else ref
        print(
            f"{pol:45s} n={turn.prefill_tokens} {turn.bytes_used / turn.full_bytes:.3f} same={turn.ids == ref} {time.time() - t:.1f}s {text!r}",  # noqa: E501
            flush=True,
        )
