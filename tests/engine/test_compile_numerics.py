"""compile_numerics.py: inside a compiled step every op of its list gives eager's numbers to the
last bit, at a model's sizes (a SmolLM2 row of 576, an MLP row of 1536) and with a symbolic
batch; Inductor's own code for the same ops does not (what makes the list necessary), and the
tables it patches are restored afterwards."""
import torch
import torch.nn.functional as F

from kvslim.engine import compile_numerics, cpu_compile


def every_op(x, p, u, positions, inv_freq):
    """One output per op family of the list; x any sign, p in (0, 1.01], u in (-1, 1)."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    h = x[:, :576]
    unary = (x.exp(), x.exp2(), x.expm1(), p.log(), p.log1p(), p.log2(), p.log10(), x.sin(),
             x.cos(), x.tan(), u.asin(), u.acos(), x.atan(), torch.atan2(x, p), x.sinh(),
             x.cosh(), x.tanh(), x.asinh(), (p + 1).acosh(), u.atanh(), x.erf(), x.erfc(),
             u.erfinv(), x.sigmoid(), p.pow(x / 4), x.pow(3), p.sqrt(), p.rsqrt())
    activations = (F.gelu(x), F.gelu(x, approximate="tanh"), F.silu(x) * p, F.mish(x),
                   F.softplus(x), F.elu(x), (u.abs() * 0.9 + 0.05).logit())
    reductions = (x.sum(-1), x.mean(-1), (p + 0.5).prod(-1), x.var(-1), *torch.var_mean(x, -1),
                  x.std(-1), x.softmax(-1), x.log_softmax(-1), x.logsumexp(-1), x.norm(dim=-1),
                  x.cumsum(-1), (p + 0.5).cumprod(-1), F.layer_norm(x, (1536,)),
                  F.group_norm(x, 4), F.rms_norm(h, (576,), p[0, :576], 1e-5))
    # RoPE's tables, and a cast to bfloat16 and back that eager rounds at
    return unary + activations + reductions + (emb.cos(), emb.sin(),
                                               x.to(torch.bfloat16).float() + p)


def inputs(rows: int):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1536, generator=g) * 4
    p = torch.rand(rows, 1536, generator=g) + 0.01
    u = torch.rand(rows, 1536, generator=g) * 1.98 - 0.99
    positions = torch.randint(0, 4096, (rows,), generator=g)
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, 64, 2).float() / 64))
    return x, p, u, positions, inv_freq


def differing(outputs, reference) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(outputs, reference)) if not torch.equal(a, b)]


def test_compiled_step_gives_eagers_numbers_for_every_listed_op(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_compile, "BACKEND", "inductor")
    step = cpu_compile.CompiledStep(every_op, ((0,), (0,), (0,), (0,), ()))
    for rows in (8, 5):                         # one program for both: the batch is symbolic
        assert differing(step(*inputs(rows)), every_op(*inputs(rows))) == []
    assert step.compilations == 1


def test_inductors_own_code_rounds_otherwise_and_its_tables_are_restored(tmp_path, monkeypatch):
    from torch._inductor import lowering
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    before = {op: lowering.lowerings.get(op) for op in compile_numerics.eager_overloads()}
    with compile_numerics.eager_kernels():
        assert all(getattr(lowering.lowerings[op], "_is_fallback_handler", False)
                   for op in before)
    assert {op: lowering.lowerings.get(op) for op in before} == before
    plain = torch.compile(every_op, fullgraph=True, dynamic=False)
    args = inputs(8)
    # transcendental functions (MKL's in eager), reductions, softmax, GELU, RMSNorm, the casts
    assert len(differing(plain(*args), every_op(*args))) > 10
