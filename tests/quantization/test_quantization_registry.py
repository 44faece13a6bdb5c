"""The quantization room's registry: each method's parser and layer class registered once, when
first asked for, and `make_linear` building the layer a spec's method registered (the float
layers without one)."""
import subprocess
import sys

import pytest

from kvslim.errors import ConfigError
from kvslim.layers.linear import Linear, MergedLinear, QKVLinear, make_linear
from kvslim.quantization import QuantLinear, QuantSpec
from kvslim.quantization.gguf_blocks import BlockQuantLinear
from kvslim.quantization.gptq import GPTQLinear
from kvslim.quantization.registry import LINEARS, PARSERS, QUANT_METHODS, linear_classes
from kvslim.quantization.w8a8 import W8A8_SPEC, W8A8Linear

SPECS = {"gptq": QuantSpec(4, 32),
         "awq": QuantSpec(4, 32, sym=False, checkpoint_format="gemm", method="awq"),
         "compressed-tensors": QuantSpec(8, -1, checkpoint_format="pack-quantized",
                                         method="compressed-tensors"),
         "w8a8": W8A8_SPEC,
         "gguf": QuantSpec(4, 32, method="gguf", file="x.gguf")}


def test_every_method_is_registered_with_its_layer():
    assert set(linear_classes()) == {GPTQLinear, W8A8Linear, BlockQuantLinear}
    assert QUANT_METHODS == ("gptq", "awq", "compressed-tensors", "gguf")
    assert set(PARSERS) == set(QUANT_METHODS)
    assert LINEARS == {"gptq": GPTQLinear, "awq": GPTQLinear, "compressed-tensors": GPTQLinear,
                       "w8a8": W8A8Linear, "gguf": BlockQuantLinear}
    assert all(issubclass(cls, QuantLinear) for cls in linear_classes())


def test_a_method_loads_when_a_config_first_names_it():
    probe = ("import sys; from kvslim.quantization import QuantSpec; "
             "before = 'kvslim.quantization.awq' in sys.modules; "
             "spec = QuantSpec.from_hf({'quant_method': 'awq', 'bits': 4, 'group_size': 128, "
             "'zero_point': True, 'version': 'gemm'}); "
             "print(before, 'kvslim.quantization.awq' in sys.modules, spec.method)")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                         text=True).stdout.split()
    assert out == ["False", "True", "awq"]


def test_an_unknown_quant_method_names_the_registered_ones():
    with pytest.raises(ConfigError, match=r"quant_method 'fp8' is not supported \('gptq', "
                                          r"'awq', 'compressed-tensors' or 'gguf'\)"):
        QuantSpec.from_hf({"quant_method": "fp8"})


@pytest.mark.parametrize("method", SPECS)
def test_make_linear_builds_the_methods_layer(method):
    spec = SPECS[method]
    qkv = make_linear(64, {"q": 64, "k": 32, "v": 32}, True, spec)
    down = make_linear(64, 32, False, spec)
    assert type(qkv) is type(down) is LINEARS[method]
    assert qkv.shard_sizes == {"q": 64, "k": 32, "v": 32} and qkv.out_features == 128
    assert qkv.bias is not None and qkv.shard_key(1) == "k" and qkv.spec == spec
    assert down.shard_sizes == {None: 32} and down.in_features == 64 and down.bias is None


def test_make_linear_without_quantization_builds_the_float_layers():
    qkv = make_linear(48, {"q": 64, "k": 24, "v": 24}, True)
    assert type(qkv) is QKVLinear and qkv.shard_sizes == {"q": 64, "k": 24, "v": 24}
    assert qkv.weight.shape == (112, 48) and qkv.bias.shape == (112,)
    gate_up = make_linear(48, {"gate": 80, "up": 80})
    assert type(gate_up) is MergedLinear and gate_up.shard_key(1) == "up"
    down = make_linear(80, 48)
    assert type(down) is Linear and down.weight.shape == (48, 80) and down.bias is None
    with pytest.raises(ValueError, match="no float linear layer"):
        make_linear(48, {"a": 16, "b": 32})


def test_each_method_says_what_a_slice_of_its_inputs_needs():
    """The packing along the inputs that tensor parallelism's row shards must respect."""
    assert {m: spec.input_multiple for m, spec in SPECS.items()} == {
        "gptq": 8, "awq": 8, "compressed-tensors": 4, "w8a8": 1, "gguf": 32}


@pytest.mark.parametrize("spec", [
    QuantSpec(4, 128, desc_act=True, sym=False), QuantSpec(8, -1),
    QuantSpec(4, 32, checkpoint_format="pack-quantized", method="compressed-tensors"),
    W8A8_SPEC, QuantSpec(4, 32, sym=False, checkpoint_format="gguf", method="gguf", file="m.gguf",
                         embedding=True)], ids=lambda s: f"{s.method}-{s.bits}")
def test_a_method_reads_back_what_it_writes(spec):
    """Each method's file owns its format both ways: the quantization_config it writes
    (`QuantSpec.to_hf`) parses back to the same spec."""
    assert QuantSpec.from_hf(spec.to_hf()) == spec


def test_a_method_kvslim_does_not_write_says_so():
    with pytest.raises(ConfigError, match="reads awq checkpoints but does not write them"):
        SPECS["awq"].to_hf()
