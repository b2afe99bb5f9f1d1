"""The SGLang end-to-end test's needle question (tests/gpu/test_sglang_e2e.py: a 2.6K-token filler
with one passphrase, 50% budget) through the transformers adapter instead, on CPU: whether a
policy's tiers, as the tier engine applies them, keep the answer, apart from the SGLang path.

    tiered-radix model fetch qwen2.5-coder-0.5b
    python bench/needle_transformers.py --policies full,kivi,qevict [--dtype bfloat16]

The prompt is the server's: the e2e test's system message, then the question, in the model's chat
template (``--system none``: no system message, the template's default).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
sys.path.insert(0, str(ROOT / "examples"))


def main() -> None:
    from multiturn_chat import SYSTEM  # the e2e test's system message
    from needle_text import question  # the GPU test's own text
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiered_radix.adapters.transformers.session import ChatSession
    from tiered_radix.models import model_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--policies", default="full,kivi,qevict")
    p.add_argument("--budget", default="50%")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--system", default=SYSTEM, help="system message ('none': the template's)")
    p.add_argument("--out", default=None, help="a JSON file for the answers")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    path = model_dir(a.model)  # `tiered-radix model fetch` put it there
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, a.dtype))
    msgs = [{"role": "user", "content": question()}]
    if a.system != "none":
        msgs.insert(0, {"role": "system", "content": a.system})
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    rows = []
    for pol in a.policies.split(","):
        t0 = time.time()
        chat = ChatSession(model, tok, pol, budget=None if pol == "full" else a.budget,
                           max_new_tokens=24)  # fmt: skip
        turn = chat.ask_ids(ids)
        rows.append({"policy": pol, "answer": turn.text, "found": "tangerine" in turn.text.lower(),
                     "prompt_tokens": turn.prefill_tokens, "occupancy": turn.occupancy,
                     "seconds": round(time.time() - t0, 1)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        meta = {"command": " ".join(sys.argv), "model": a.model, "dtype": a.dtype,
                "torch": torch.__version__, "budget": a.budget,
                "system": a.system}  # fmt: skip
        Path(a.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
