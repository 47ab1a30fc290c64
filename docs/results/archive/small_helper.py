"""The second base of docs/results' "A team on two bases" run (issue 23): the embedded
SmolLM2-135M-Instruct with only its first N decoder layers kept (default 15 of 30), saved as a
model folder with the embedded model's tokenizer and chat template. A structurally different base
(half the depth, ~2/3 of the parameters: the embeddings stay) that is not random, derived here,
no hub.

    .venv/bin/python docs/results/archive/small_helper.py /tmp/smollm2-half [--layers 15]
    collab train --task tldr --agent-models /tmp/smollm2-half "" ...   # summary on it, detail on the embedded
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder to write the model to")
    ap.add_argument("--layers", type=int, default=15, help="decoder layers to keep (the first N)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from collab_app.engines.model import ensure_model

    src = ensure_model()
    model = AutoModelForCausalLM.from_pretrained(src)
    total = len(model.model.layers)
    if not 1 <= args.layers < total:
        ap.error(f"--layers must be in 1..{total - 1} (the embedded model has {total})")
    model.model.layers = model.model.layers[:args.layers]
    model.config.num_hidden_layers = args.layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:args.layers]
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(src).save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {args.layers} of {total} layers, {params / 1e6:.1f} M parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
