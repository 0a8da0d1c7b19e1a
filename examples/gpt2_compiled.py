"""Hugging Face GPT-2 (a small random config, no download) compiled with the nanpass backend.

A batch whose labels are all -100 (every token ignored, as a fully padded micro-batch gives)
makes cross-entropy 0/0 = NaN in torch; under the nanpass backend the loss is 0 with zero
gradients, and normal batches match inductor alone.
"""

from __future__ import annotations

import torch
from _common import quick_flag, state

import nanpass


def main():
    quick = quick_flag(__doc__)
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()  # no dropout: outputs comparable
    ids = torch.randint(0, 512, (2, 16))
    ignored = torch.full_like(ids, -100)
    inner = "aot_eager" if quick else "inductor"
    print(f"before: loss {model(input_ids=ids, labels=ignored).loss.item()}")
    backend = nanpass.backend(inner=inner)
    compiled = torch.compile(model, backend=backend)
    out = compiled(input_ids=ids, labels=ignored)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    print(f"after ({inner}):  loss {out.loss.item()}, grads {state(*grads)}")
    normal = compiled(input_ids=ids, labels=ids).loss.item()
    print(f"normal batch: nanpass {normal:.6f} vs eager {model(input_ids=ids, labels=ids).loss.item():.6f}")
    print(nanpass.report(backend).summary())


if __name__ == "__main__":
    main()
