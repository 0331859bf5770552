"""The entries of a ``StackSpec``'s ``parts``: each is one module of a base model, under its ``transformers`` name,
with the rule that builds it (the shape of torchtitan's ``Config.build()``). ``TransformerStack.__init__`` builds
the parts in the order given (``transformers``' registration order, so the module tree and the state-dict keys are
``transformers``'), each with ``(model, config, options)``: the base model (for its ``build_layer`` hook), the
config and the family's frozen options of that config (``stack_options``, built once per model). Fused kernels are
not an argument: ``finish_init`` switches them on the built components (``fused_kernels.py``).

A part with a ``role`` also tells the stack's phases which attribute plays it (``StackSpec.embed_tokens``,
``layers``, ``final_norm``, ...): the name is written once, in the part.

    LLAMA_SPEC = StackSpec(block=LlamaDecoderLayer, components=..., parts=(
        TokenEmbedding("embed_tokens"), Layers("layers"), FinalNorm("norm", decoder_norm),
        Rotary("rotary_emb", RotaryEmbedding)))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from torch import nn

from ....parallel_layers.layers import Dropout, Embedding
from ..norms.layer_norm import LayerNorm

#: the spec's role attributes a part can fill (``StackSpec``'s fields of the same names)
ROLES = ("embed_tokens", "position_embedding", "embedding_dropout", "layers", "final_norm", "rotary",
         "input_projection", "embedding_norm", "output_projection", "embeddings", "pooler")

#: ``(config, options) -> nn.Module``: how a norm or another single module is made
Builder = Callable[[Any, Any], nn.Module]


@dataclass(frozen=True)
class Part:
    """One module of the base model: ``name`` is ``transformers``' attribute (dotted under a submodule)."""

    name: str
    role: ClassVar[str | None] = None

    def build(self, model, config, options) -> nn.Module | None:
        raise NotImplementedError


@dataclass(frozen=True)
class TokenEmbedding(Part):
    """``Embedding(vocab_size, width)`` (vocab-parallel under the plan), with ``padding_idx=pad_token_id`` when
    ``padding`` (``transformers``' Llama-shaped decoders; GPT-2 and its kin have none). ``width``: the config
    attribute of the embedding width."""

    padding: bool = True
    width: str = "hidden_size"
    role: ClassVar[str] = "embed_tokens"

    def build(self, model, config, options) -> nn.Module:
        return Embedding(config.vocab_size, getattr(config, self.width),
                         config.pad_token_id if self.padding else None)


@dataclass(frozen=True)
class PositionEmbedding(Part):
    """Learned positions ``Embedding(config.<size>, hidden_size)`` (GPT-2's ``wpe``)."""

    size: str = "max_position_embeddings"
    role: ClassVar[str] = "position_embedding"

    def build(self, model, config, options) -> nn.Module:
        return Embedding(getattr(config, self.size), config.hidden_size)


@dataclass(frozen=True)
class EmbeddingDropout(Part):
    """``Dropout(config.<rate>)`` on the embeddings (after the sequence-parallel scatter)."""

    rate: str = "embd_pdrop"
    role: ClassVar[str] = "embedding_dropout"

    def build(self, model, config, options) -> nn.Module:
        return Dropout(getattr(config, self.rate))


@dataclass(frozen=True)
class Layers(Part):
    """``ModuleList`` of ``config.<count>`` layers, each from the base model's ``build_layer(config, i, options)``
    (by default the spec's ``block``)."""

    count: str = "num_hidden_layers"
    role: ClassVar[str] = "layers"

    def build(self, model, config, options) -> nn.Module:
        return nn.ModuleList([model.build_layer(config, i, options) for i in range(getattr(config, self.count))])


@dataclass(frozen=True)
class Built(Part):
    """A module from a ``make(config, options)`` function."""

    make: Builder = None

    def build(self, model, config, options) -> nn.Module:
        return self.make(config, options)


@dataclass(frozen=True)
class FinalNorm(Built):
    """The norm after the last layer: ``make(config, options)``."""

    role: ClassVar[str] = "final_norm"


@dataclass(frozen=True)
class EmbeddingNorm(Built):
    """The norm after the embeddings (Bloom's ``word_embeddings_layernorm``): ``make(config, options)``."""

    role: ClassVar[str] = "embedding_norm"


@dataclass(frozen=True)
class Rotary(Part):
    """The rotary module ``module(config)`` (its ``(cos, sin)`` computed once per forward by the stack)."""

    module: type = None
    role: ClassVar[str] = "rotary"

    def build(self, model, config, options) -> nn.Module:
        return self.module(config)


@dataclass(frozen=True)
class Module(Part):
    """``module(config)``: a module made from the config alone."""

    module: type = None

    def build(self, model, config, options) -> nn.Module:
        return self.module(config)


@dataclass(frozen=True)
class Container(Part):
    """An empty ``module()`` under ``transformers``' class name, filled by the parts after it (BERT's ``encoder``,
    whose ``layer`` list is the ``Layers("encoder.layer")`` part)."""

    module: type = nn.Module

    def build(self, model, config, options) -> nn.Module:
        return self.module()


@dataclass(frozen=True)
class Embeddings(Module):
    """An encoder's embeddings module ``module(config)``: ``[b, s]`` ids -> ``[b, s, e]`` (word, position and
    token-type tables, norm, dropout), run whole on every rank before the sequence-parallel scatter
    (``common/stack/encoder_stack.py``). Its class says how position ids are made (``derives_positions``,
    ``first_position``) and is kept on one device (``_no_split_modules``)."""

    role: ClassVar[str] = "embeddings"


@dataclass(frozen=True)
class Pooling(Module):
    """A module ``module(config)`` built only when the base model is built with ``add_pooling_layer=True``
    (``transformers``' argument; else the attribute is ``None``): ALBERT's ``pooler_activation``."""

    def build(self, model, config, options) -> nn.Module | None:
        return self.module(config) if model.add_pooling_layer else None


@dataclass(frozen=True)
class Pooler(Pooling):
    """An encoder's pooler ``module(config)`` (the module whose presence says the model pools), built only with
    ``add_pooling_layer=True``."""

    role: ClassVar[str] = "pooler"


def layer_norm(eps: str, width: str = "hidden_size") -> Builder:
    """A builder of ``LayerNorm(config.<width>, eps=config.<eps>)`` (the LayerNorm families' norms)."""
    def make(config, options=None) -> LayerNorm:
        return LayerNorm(getattr(config, width), eps=getattr(config, eps))
    return make
