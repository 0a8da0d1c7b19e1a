"""Hugging Face models from tiny random configs (no downloads), through harden and the backend."""

from __future__ import annotations

import pytest
import torch

import nanpass
from tests.helpers import all_finite, flat_tensors

transformers = pytest.importorskip("transformers")


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=64,
                                  intermediate_size=128, vocab_size=512, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg).eval()


MODELS = {"gpt2": gpt2, "bert": bert}


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (2, 12))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


# GPT-2's stable-form compile takes 5 s here: the fast tier hardens BERT (GPT-2 is hardened in
# test_gpt2_every_label_ignored_and_padding and test_check), the slow tier both
@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.slow), "bert"])
def test_harden_matches_original(name):
    model = MODELS[name]()
    batch = _batch()
    ref = model(**batch)
    # guards alone: bit for bit the same on normal inputs
    exact = nanpass.harden(model)
    out = exact(**batch)
    assert type(out) is type(ref)
    assert exact.capture == "intercept"
    assert torch.equal(out.logits, ref.logits)
    assert torch.equal(out.loss, ref.loss)
    assert any(c.action == "guarded" for c in exact.changes)
    # with the stable forms (GPT-2's gelu_new -> F.gelu(approximate="tanh")): rounding only
    stable = torch.compile(model, backend=nanpass.backend(inner="eager", stable=True))
    torch.testing.assert_close(stable(**batch).logits, ref.logits)
    # training works through the hardened model
    safe = exact
    safe.train()
    safe(**batch).loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


# a dynamo capture of GPT-2 takes 6 s here: the fast tier compiles BERT, the slow tier both
@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.slow), "bert"])
def test_backend_matches_original(name):
    model = MODELS[name]()
    batch = _batch()
    ref = model(**batch)
    be = nanpass.backend(inner="aot_eager")
    out = torch.compile(model, backend=be)(**batch)
    torch.testing.assert_close(out.logits, ref.logits)
    assert len(be.graphs) >= 1


def test_gpt2_every_label_ignored_and_padding():
    """A batch whose labels are all -100 gives NaN loss in torch; hardened it is 0."""
    model = gpt2()
    batch = _batch()
    batch["labels"] = torch.full_like(batch["input_ids"], -100)
    batch["attention_mask"][0] = 0  # a fully padded sequence too
    assert not torch.isfinite(model(**batch).loss)
    safe = nanpass.harden(model)
    safe.train()
    out = safe(**batch)
    assert all_finite(flat_tensors(out.logits)) and out.loss == 0
    out.loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def llama():
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def t5():
    cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg).eval()


# RMSNorm's hidden.pow(2) is left in float32 (it overflows only past 1.8e19; guarded in float16)
@pytest.mark.parametrize("make,guarded", [(llama, {"rsqrt", "cross_entropy"}),
                                          (t5, {"rsqrt", "log", "cross_entropy"})])
def test_decoders_bitwise_and_generate_guarded(make, guarded):
    """Models nobody here wrote: same logits and loss bit for bit, and ``generate`` through the
    hardened model runs guarded and picks the same tokens."""
    model = make()
    torch.manual_seed(2)
    ids = torch.randint(3, 100, (2, 10))
    ref = model(input_ids=ids, labels=ids)
    safe = nanpass.harden(model)
    out = safe(input_ids=ids, labels=ids)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    assert {c.op for c in safe.changes if c.action == "guarded"} == guarded
    want = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    counted = nanpass.harden(model, count=True)  # counts each guard's calls: generate is guarded
    got = counted.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    calls = {r.op: r.calls for r in nanpass.stats(counted).rows}
    assert all(calls.get(op, 0) >= 4 for op in guarded - {"cross_entropy"})  # every decoding step


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_siglip_pooling_head_attention_keeps_every_bit(dtype):
    """SigLIP's pooling head is an nn.MultiheadAttention (need_weights=True by default): its
    guard runs torch's own attention code with the calls inside guarded. Outputs and every
    parameter's gradient stay bitwise the plain model's, in training, and it compiles as one
    graph."""
    cfg = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = transformers.SiglipVisionModel(cfg).to(dtype).train()
    x = torch.randn(2, 3, 32, 32, dtype=dtype)
    safe = nanpass.harden(model)
    params = list(model.parameters())
    want = model(pixel_values=x).pooler_output
    got = safe(pixel_values=x).pooler_output
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got.float().sum(), params),
                    torch.autograd.grad(want.float().sum(), params), strict=True):
        assert torch.equal(a, b)
    assert "multi_head_attention" in {c.op for c in safe.changes if c.action == "guarded"}
    torch._dynamo.reset()
    compiled = torch.compile(safe, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(pixel_values=x).pooler_output, want)


def test_reformer_shared_qk_attention_keeps_the_originals_gradient_bits():
    """Issue 28 item 3 names Reformer's shared-QK (LSH) attention: its rsqrt, logsumexp and exp
    are guarded and the query-key vectors fan out. In training mode Reformer draws a fresh seed
    (``torch.seed()``) for every layer's forward, so two plain runs already differ; with the
    config's ``hash_seed`` a training step of the hardened model is the original's, loss and
    every gradient bit for bit."""
    cfg = transformers.ReformerConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        attn_layers=["lsh", "local", "lsh"], axial_pos_embds=False, feed_forward_size=64,
        max_position_embeddings=64, lsh_attn_chunk_length=8, local_attn_chunk_length=8, num_buckets=4,
        num_hashes=2, is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        lsh_attention_probs_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, hash_seed=3,
        pad_token_id=0, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    model = transformers.ReformerModelWithLMHead(cfg).train()
    ids = torch.randint(1, 64, (2, 32))

    def step(m):
        m.zero_grad()
        loss = m(ids, labels=ids).loss
        loss.backward()
        return [loss.detach(), *[p.grad.clone() for p in m.parameters() if p.grad is not None]]

    want, got = step(model), step(nanpass.harden(model))
    assert len(want) == len(got) > 20
    assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
