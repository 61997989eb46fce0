"""The C++ shared-prefix prefill attention (csrc/attention_bf16.cpp via kernels/attention_native.py) against the
decoding cache's torch path (SDPA over the prefix gathered per row), and the cache's routing to it.

Legend: B = rows, H = query heads, K = key/value heads, S = queries pushed, D = head size, G = prefixes, P = their
width. The cases cover the kernel's tails: S x H / K not a multiple of its 6-query tiles, key counts not a multiple
of its 64-key blocks, D = 32 and 128 (one half-filled and two 64-wide output passes), rows without a prefix,
left-padded prefixes and right-padded own positions.
"""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.generation import decode_cache as dc
from alignopsd.engine.generation.decode_cache import SharedPrefixKV
from alignopsd.kernels import attention_native as an
from alignopsd.kernels.cpp import elements_from, native_ready
from alignopsd.kernels.native_choice import ATTENTION

from alignopsd.testing import KernelChoice, record_kernel_choice

needs_native = pytest.mark.skipif(
    not native_ready(), reason="the C++ extension or an AVX512-BF16 CPU is missing: torch path only"
)
needs_extension = pytest.mark.skipif(
    an._C is None or not hasattr(an._C, "attention_prefix_bf16"), reason="the C++ extension is not built"
)


def _bf16_values(*shape, g):
    return torch.randn(*shape, generator=g).bfloat16().float()  # what a bf16 model stores in the fp32 cache


def prefixed_cache(*, b=8, s=13, h=6, k=2, d=64, g_count=3, p=70, seed=0):
    """A cache whose rows read kept prefixes (the teacher forcing's layout), its one push stored; the query."""
    g = torch.Generator().manual_seed(seed)
    pk, pv = [_bf16_values(g_count, k, p, d, g=g)], [_bf16_values(g_count, k, p, d, g=g)]
    valid = torch.ones(g_count, p, dtype=torch.bool)
    for i in range(g_count):
        valid[i, : 7 * i] = False  # left padding
    rows = torch.arange(b) % g_count
    rows[1] = -1  # a row without a prefix
    kv = SharedPrefixKV.reading(pk, pv, valid, rows)
    lens = torch.randint(1, s + 1, (b,), generator=g)
    kv.push((torch.arange(s)[None] < lens[:, None]).long())
    kv.update(_bf16_values(b, k, s, d, g=g), _bf16_values(b, k, s, d, g=g), 0)
    q = torch.randn(b, s, h, d, generator=g).bfloat16().transpose(1, 2)  # [B, H, S, D], strided as the model's
    return kv, q


def _operands(kv, q, scale):
    """The arguments the cache's layer 0 gives the kernel and its torch path."""
    k, v = kv.k[0][:, :, : kv.length], kv.v[0][:, :, : kv.length]
    pk, pv = (kv.pk[0], kv.pv[0]) if kv.prefix_valid is not None else (None, None)
    rows = kv.row_prefix if pk is not None else None
    return q, k, v, pk, pv, rows, kv.bias, scale


def _native(kv, q, scale):
    return an.prefix_attention(*_operands(kv, q, scale))


def _torch(kv, q, scale):
    return an.torch_prefix_attention(*_operands(kv, q.float(), scale))


@needs_native
@pytest.mark.parametrize(
    ("b", "s", "h", "k", "d", "p"), [(8, 13, 6, 2, 64, 70), (3, 50, 9, 3, 32, 129), (5, 7, 4, 4, 128, 64)]
)
def test_prefixed_rows_equal_torch_path(b, s, h, k, d, p):
    kv, q = prefixed_cache(b=b, s=s, h=h, k=k, d=d, p=p)
    scale = d**-0.5
    got = _native(kv, q, scale)
    want = _torch(kv, q, scale)
    assert got.shape == (b, s, h, d) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_native
def test_rows_without_prefixes_and_a_second_push_equal_torch_path():
    """Generation's layout: no prefixes; a first push, then a second whose queries also read the first's keys."""
    g = torch.Generator().manual_seed(1)
    b, h, k, d = 4, 6, 2, 64
    kv = SharedPrefixKV(1, budget=20)
    first = torch.ones(b, 9, dtype=torch.long)
    first[0, :3] = 0  # left padding
    kv.push(first)
    kv.update(_bf16_values(b, k, 9, d, g=g), _bf16_values(b, k, 9, d, g=g), 0)
    kv.push(torch.ones(b, 5, dtype=torch.long))
    kv.update(_bf16_values(b, k, 5, d, g=g), _bf16_values(b, k, 5, d, g=g), 0)
    q = torch.randn(b, h, 5, d, generator=g).bfloat16()
    torch.testing.assert_close(_native(kv, q, 0.125), _torch(kv, q, 0.125), rtol=1e-5, atol=2e-6)


@needs_native
def test_cache_routes_bf16_prefill_to_native(monkeypatch):
    kv, q = prefixed_cache()
    calls = []
    real = dc.prefix_attention

    def spy(*a, **kw):
        calls.append(a[0].shape[2])
        return real(*a, **kw)

    monkeypatch.setattr(dc, "prefix_attention", spy)
    record_kernel_choice(KernelChoice(ATTENTION, True, 0.1, 0.2, "injected: measured faster"))
    out = kv.attend(0, q, 0.125)
    assert calls == [13] and out.dtype == torch.bfloat16 and out.shape == (8, 13, 6, 64)
    torch.testing.assert_close(out.float(), _torch(kv, q, 0.125).bfloat16().float(), rtol=0.02, atol=2e-3)
    kv.attend(0, q.float(), 0.125)  # an fp32 model: the torch path
    assert calls == [13]


def test_applies_only_to_what_the_kernel_runs(monkeypatch):
    kv, q = prefixed_cache(d=64)
    k, v = kv.k[0][:, :, : kv.length], kv.v[0][:, :, : kv.length]
    assert an.prefix_attention_applies(q, k, v, kv.pk[0], kv.pv[0]) == native_ready()
    assert not an.prefix_attention_applies(q.float(), k, v, kv.pk[0], kv.pv[0])
    assert not an.prefix_attention_applies(q, k.bfloat16(), v, kv.pk[0], kv.pv[0])
    kv48, q48 = prefixed_cache(d=48)
    k48, v48 = kv48.k[0][:, :, : kv48.length], kv48.v[0][:, :, : kv48.length]
    assert not an.prefix_attention_applies(q48, k48, v48, kv48.pk[0], kv48.pv[0])
    monkeypatch.setattr(an, "native_ready", lambda: False)
    assert not an.prefix_attention_applies(q, k, v, kv.pk[0], kv.pv[0])
    with pytest.raises(ValueError, match="kernel ready: False"):
        _native(kv, q, 0.125)


def test_bad_inputs_are_named():
    """Shapes that do not fit together are named before any native call (so on any CPU): the query's head size,
    rows or heads against the keys', the keys' against the values', the prefix's against the keys', row_prefix,
    bias."""
    kv, q = prefixed_cache()
    k, v = kv.k[0][:, :, : kv.length], kv.v[0][:, :, : kv.length]
    pk, pv, rows, bias = kv.pk[0], kv.pv[0], kv.row_prefix, kv.bias

    def call(q=q, k=k, v=v, pk=pk, pv=pv, rows=rows, bias=bias):
        return an.prefix_attention(q, k, v, pk, pv, rows, bias, 0.125)

    with pytest.raises(ValueError, match="bias: expected shape"):
        call(bias=bias[:, :, :, 1:])
    bad_rows = rows.clone()
    bad_rows[0] = 7
    with pytest.raises(ValueError, match="row_prefix: row 0 reads prefix 7 of 3"):
        call(rows=bad_rows)
    bad_rows[0] = -2
    with pytest.raises(ValueError, match="row_prefix: row 0 reads prefix -2 of 3"):
        call(rows=bad_rows)
    with pytest.raises(ValueError, match=r"row_prefix: expected shape \(8,\)"):
        call(rows=rows[:5])
    with pytest.raises(ValueError, match="heads: query heads 5"):
        call(q=q[:, :5])
    with pytest.raises(ValueError, match=r"k: expected \[B=8, K, n, D=64\]"):
        call(k=k[..., :32], v=v[..., :32])  # the keys' head size is not the query's
    with pytest.raises(ValueError, match=r"k: expected \[B=8, K, n, D=64\]"):
        call(k=k[:6], v=v[:6])  # fewer rows of keys than of queries
    with pytest.raises(ValueError, match="v: expected the shape of k"):
        call(v=v[:, :, :-1])
    with pytest.raises(ValueError, match=r"pk: expected \[G, K=2, P, D=64\]"):
        call(pk=pk[..., :32], pv=pv[..., :32])
    with pytest.raises(ValueError, match="pv: expected the shape of pk"):
        call(pv=pv[:, :, :-1])
    with pytest.raises(ValueError, match="pk, pv: give both"):
        call(pv=None)


@needs_extension
def test_extension_refuses_sizes_past_its_buffers():
    """The C++ boundary checks the sizes and strides it is given against the elements each buffer holds, before it
    asks the CPU: the heap-buffer-overflow of a mismatched head size becomes a ValueError naming the buffer."""
    kv, q = prefixed_cache(b=2, s=3, h=2, k=1, d=32, g_count=1, p=4)
    k, v = kv.k[0][:, :, : kv.length], kv.v[0][:, :, : kv.length]
    pk, pv = kv.pk[0].contiguous(), kv.pv[0].contiguous()
    rows = kv.row_prefix.long().contiguous()
    bias = kv.bias.float().contiguous()
    out = torch.empty(2, 3, 2, 32)
    ptrs = (q.data_ptr(), list(q.stride()[:3]), k.data_ptr(), v.data_ptr(), list(k.stride()[:3]), pk.data_ptr())
    ptrs += (pv.data_ptr(), list(pk.stride()[:3]), rows.data_ptr(), bias.data_ptr(), out.data_ptr())
    held = [elements_from(t) for t in (q, k, v, pk, pv, rows, bias, out)]
    sizes = dict(B=2, H=2, S=3, D=32, K=1, n=3, P=4, G=1)

    def call(elements=held, **over):
        args = {**sizes, **over}
        return an._C.attention_prefix_bf16(*ptrs, *args.values(), 0.125, 1, elements)

    with pytest.raises(ValueError, match="q: the sizes and strides given reach 416 elements, the buffer holds 384"):
        call(D=64)  # a head size past the buffers (what an ASan build reported as a heap-buffer-overflow)
    with pytest.raises(ValueError, match="pk: .* reach 128 elements, the buffer holds 64"):
        call(elements=[*held[:3], 64, *held[4:]])  # prefix keys of head size 16 read as 32
    with pytest.raises(ValueError, match="bias: .* reach 42 elements, the buffer holds 21"):
        call(B=2, n=3, elements=[*held[:6], 21, held[7]])
    with pytest.raises(ValueError, match="out: .* reach"):
        call(elements=[*held[:7], 10])
    with pytest.raises(ValueError, match="row_prefix: .* reach 2 elements, the buffer holds 1"):
        call(elements=[*held[:5], 1, *held[6:]])
    with pytest.raises(ValueError, match="elements: expected 8 counts"):
        call(elements=held[:7])
    if not native_ready():
        with pytest.raises(ValueError, match="no AVX512-BF16"):
            call()  # valid arguments: then the CPU is asked
