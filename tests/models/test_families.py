"""The family registry (models/families.py): each family declared once, under the names
transformers gives it, and the GGUF layouts merge without conflicts."""
import transformers

from checkpoints import VARIANTS, hf_config
from kvslim.formats.gguf.archs import LAYER_TENSORS, SUPPORTED_GGUF_ARCHITECTURES, gguf_family
from kvslim.models.config import SHAPE_ONLY_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig
from kvslim.models.families import FAMILIES, family_of


def test_each_family_is_registered_once_under_transformers_names():
    assert len({f.architecture for f in FAMILIES}) == len({f.model_type for f in FAMILIES}) \
        == len(FAMILIES)
    for family in FAMILIES:
        assert hasattr(transformers, family.architecture), family.architecture
        assert transformers.AutoConfig.for_model(family.model_type).model_type == family.model_type
    assert set(SUPPORTED_ARCHITECTURES) | set(SHAPE_ONLY_ARCHITECTURES) == \
        {f.architecture for f in FAMILIES}


def test_every_test_variant_finds_its_family():
    """From config.json's model_type alone (no `architectures`), as transformers writes it."""
    for variant in VARIANTS:
        cfg = hf_config(variant).to_dict()
        assert family_of(ModelConfig.from_hf_dict(cfg)).model_type == cfg["model_type"], variant


def test_gguf_architectures_import_as_one_family_each():
    assert set(SUPPORTED_GGUF_ARCHITECTURES) <= set(LAYER_TENSORS)
    for arch in SUPPORTED_GGUF_ARCHITECTURES:
        families = [gguf_family(arch, experts) for experts in (False, True)]
        assert any(families), arch
        assert all(f is None or f.gguf.arch == arch for f in families)
    assert gguf_family("llama", experts=True).architecture == "MixtralForCausalLM"
    assert gguf_family("qwen3moe", experts=False) is None      # experts only: must say how many
