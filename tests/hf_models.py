"""Hugging Face models nobody here wrote, from tiny random configs (no downloads), with a batch."""

from __future__ import annotations

import torch


def _ids(vocab=512, batch=2, seq=12):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": ids, "labels": ids}


def build(name: str):
    """(model in train mode, batch with labels) for one of ``NAMES``."""
    import transformers as T

    torch.manual_seed(0)
    small = dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=64, intermediate_size=128,
                 vocab_size=512, max_position_embeddings=64)
    ids = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "gpt2":
        m = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512,
                                           n_positions=64, bos_token_id=0, eos_token_id=0))
    elif name == "llama":
        m = T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=2, **small, **ids))
    elif name == "bert":
        m = T.BertForMaskedLM(T.BertConfig(**small))
    elif name == "t5":
        m = T.T5ForConditionalGeneration(T.T5Config(
            num_layers=2, num_decoder_layers=2, num_heads=2, d_model=64, d_kv=32, d_ff=128,
            vocab_size=512, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    elif name == "mixtral":
        m = T.MixtralForCausalLM(T.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                                 num_experts_per_tok=2, **small, **ids))
    elif name == "vit":
        m = T.ViTForImageClassification(T.ViTConfig(
            num_hidden_layers=2, num_attention_heads=2, hidden_size=64, intermediate_size=128,
            image_size=32, patch_size=8, num_labels=3))
        torch.manual_seed(1)
        return m.train(), {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 2])}
    else:
        raise KeyError(name)
    return m.train(), _ids()


NAMES = ("gpt2", "llama", "bert", "t5", "mixtral", "vit")
