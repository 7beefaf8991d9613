"""kvforge.diffusers on diffusers' own WanTransformer3DModel (tiny, random
weights, CPU): chunked generation with the cache in the model's self-attention,
against the same processor over a plain BF16 cache."""
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import kvforge  # noqa: E402
import kvforge.diffusers as kvd  # noqa: E402

HEADS, D, LAYERS = 2, 128, 2
LOSSLESS = 'return { base = "rtn_int2", name = "bf16", key = { bits = 16 }, value = { bits = 16 } }'


class BF16Cache:
    """The QuantizedKVCache interface the processor uses, over plain BF16 tensors."""
    layout, batch_size, uses_qstats = "nhd", None, False

    def __init__(self, layers, heads):
        self.num_layers, self.num_kv_heads = layers, heads
        self.info = kvforge.Scheme("rtn_int2").info
        self.kv = [[] for _ in range(layers)]

    def num_tokens(self, layer):
        return sum(k.shape[0] for k, _ in self.kv[layer])

    def keys_values(self, layer):
        return (torch.cat([k for k, _ in self.kv[layer]]), torch.cat([v for _, v in self.kv[layer]]))

    def append(self, layer, k, v, q=None, positions=None):
        self.kv[layer].append((k.clone(), v.clone()))


def tiny_wan():
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=D, in_channels=4,
                              out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=LAYERS,
                              rope_max_seq_len=64)
    return m.to(torch.bfloat16).eval()


def generate(model, cache, chunks=3, steps=(900, 500)):
    """Chunk by chunk: denoising steps read the cache, a clean pass writes it."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randn(1, 8, 32, generator=g).to(torch.bfloat16)
    ctl = kvd.attach(model, cache)
    outs = []
    try:
        with torch.no_grad():
            for c in range(chunks):
                x = torch.randn(1, 4, 1, 8, 8, generator=g).to(torch.bfloat16)
                for t in steps:
                    before = cache.num_tokens(0)
                    outs.append(model(x, torch.tensor([t]), prompt).sample)
                    assert cache.num_tokens(0) == before  # reading leaves the cache alone
                with ctl.writing():
                    model(x, torch.tensor([0]), prompt)
                assert cache.num_tokens(LAYERS - 1) == 16 * (c + 1)  # 1 frame of 4 x 4 patches a chunk
    finally:
        ctl.detach()
    return outs


def test_lossless_scheme_equals_a_plain_bf16_cache():
    model = tiny_wan()
    ref = generate(model, BF16Cache(LAYERS, HEADS))
    s = kvforge.Scheme.from_string(LOSSLESS, "=bf16")
    got = generate(model, kvforge.QuantizedKVCache(s, LAYERS, HEADS, D, device="cpu", layout="nhd"))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_quantized_cache_is_close_and_first_chunk_is_the_stock_model():
    model = tiny_wan()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randn(1, 8, 32, generator=g).to(torch.bfloat16)
    x0 = torch.randn(1, 4, 1, 8, 8, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        stock = model(x0, torch.tensor([900]), prompt).sample
    ref = generate(model, BF16Cache(LAYERS, HEADS))
    assert torch.equal(ref[0], stock)  # empty cache: the model's own attention
    got = generate(model, kvforge.QuantizedKVCache("rtn_int4", LAYERS, HEADS, D, device="cpu", layout="nhd"))
    assert torch.equal(got[0], stock)
    for i, (a, b) in enumerate(zip(got[2:], ref[2:])):  # chunks 1, 2 read packed K/V
        cos = torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0)
        assert not torch.equal(a, b)  # the packed chunks are not lossless...
        assert cos > 0.98, (i, cos)  # ...but 4-bit keys and values keep the output
    got2 = generate(model, kvforge.QuantizedKVCache("rtn_int2", LAYERS, HEADS, D, device="cpu", layout="nhd"))

    def err(xs):
        return sum(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(xs[2:], ref[2:]))
    assert 0 < err(got) < err(got2)  # 4 bits closer to BF16 than 2 bits
    with torch.no_grad():  # detached: the model is as it was
        assert torch.equal(model(x0, torch.tensor([900]), prompt).sample, stock)


def test_attach_checks_the_cache():
    model = tiny_wan()
    with pytest.raises(ValueError, match="layout='nhd'"):
        kvd.attach(model, kvforge.QuantizedKVCache("rtn_int2", LAYERS, HEADS, D))
    with pytest.raises(ValueError, match="2 self-attention layers, the cache 3"):
        kvd.attach(model, kvforge.QuantizedKVCache("rtn_int2", 3, HEADS, D, layout="nhd"))
    assert len(kvd.self_attention_modules(model)) == LAYERS  # attn1 of each block; attn2 is cross-attention
